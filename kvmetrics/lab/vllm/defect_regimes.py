"""When each vLLM recovery-path defect bites, and which connectors can trigger it.

A canary proves a mechanism on a minimal scenario; an operator deciding whether
to patch needs the regime: which policy, which scheduling mode, which kind of
load, which event has to land in which window, and which real connectors report
failures in the way the defect needs. ``kvmetrics vllm-check --json`` prints this
table beside each canary's result as ``severity``; docs/vllm-defects.md explains
each entry with vLLM's code and the evidence (in-process or a real server).

Kept apart from the canaries because it is data about the defects, not a
scenario: a test checks it names every canary and nothing else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: Connectors of vLLM 0.33.0 that report block-level load failures
#: (``get_block_ids_with_load_errors``) for loads they make synchronously.
SYNC_REPORTERS = ("LMCacheConnectorV1 (in-process LMCache)", "MultiConnector around one",
                  "any connector whose loads are sync and that reports invalid_block_ids")


@dataclass(frozen=True)
class Severity:
    #: kv_load_failure_policy under which it bites: "recompute", "fail" or "both".
    policy: str
    #: "any" (lockstep too) or "async" (needs async scheduling: vLLM's default on
    #: GPUs where supported; the CPU platform forces it off).
    scheduling: str
    #: The kind of failed load: "sync" or "async".
    loads: str
    #: The window or size in which it bites, and what the harm is.
    regime: str
    connectors: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "connectors": list(self.connectors)}


SEVERITY: dict[str, Severity] = {
    "recompute-keeps-failed-block": Severity(
        "recompute", "any", "sync",
        "the request whose load failed is preempted (it is usually the newest, FCFS's "
        "victim) or aborted before the step that recomputes the block; a later request "
        "with the same prefix, while the block is still in the free queue, attends over "
        "KV that was never loaded: wrong tokens, no error",
        SYNC_REPORTERS),
    "chunked-recompute-sharer": Severity(
        "recompute", "any", "sync",
        "two requests with a shared prefix in one step (the second hits the first's "
        "freshly allocated blocks) and a recompute range from the failed block that does "
        "not fit one step (long_prefill_token_threshold, or a token budget smaller than "
        "the range: any failure early in a long context under chunked prefill); the "
        "sharer decodes over the part not yet rewritten: wrong tokens for good",
        SYNC_REPORTERS),
    "fail-sharer-blocks-hashed": Severity(
        "fail", "any", "sync",
        "a sharer in the failing step with blocks of its own after the failed one; later "
        "some request recomputes the failed block's tokens (caching its hash again) and "
        "then a request with the sharer's prefix arrives while the sharer's blocks are "
        "still in the free queue: it reads KV computed over the failed block",
        SYNC_REPORTERS),
    "async-load-stall": Severity(
        "recompute", "any", "async",
        "permanent only when the retried request needs more than about half of the free "
        "blocks (free >= 2x its need admits it again at once; below that it is refused "
        "every step until running requests free enough, and for good once nothing runs): "
        "a long-context request over half the cache. Needs a connector that offers the "
        "same async load again after a total failure (a store); a P/D connector that "
        "clears do_remote_prefill offers nothing the second time and the request is "
        "recomputed, and so does LMCache 0.5.6 multi-process mode, which bypasses "
        "itself for a request whose async load failed (seen in a real vllm serve)",
        ("MooncakeStoreConnector (load_async, the default; from its code, not run)",
         "any store connector that offers a failed async load again")),
    "aborted-owner-keeps-failed-block": Severity(
        "both", "any", "sync",
        "the client aborts while the step of the request's sync load runs, or of a "
        "sharer of that load's blocks (in lockstep a window of one forward pass; under "
        "async scheduling until that step's output is processed); the next request with "
        "the prefix reads the failed block and the blocks computed after it",
        SYNC_REPORTERS),
    "async-rollback-in-flight": Severity(
        "recompute", "async", "sync",
        "every sync-load failure reported for a step that held the request's last prefill "
        "chunk (the next step already decodes over the failed block): the delivered "
        "output is shifted by one position and computed over the failed block",
        SYNC_REPORTERS),
    "async-sharer-in-flight": Severity(
        "recompute", "async", "sync",
        "a request with the same prefix admitted in the step right after the failing one "
        "(before its output is processed: under load with shared system prompts, often) "
        "keeps its count and its first token, both computed over the failed block",
        SYNC_REPORTERS),
}
