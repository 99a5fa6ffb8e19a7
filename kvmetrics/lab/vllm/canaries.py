"""Defect canaries: each known recovery-path defect of vLLM as a minimal scenario.

Every canary builds the *installed* vLLM's own ``Scheduler`` or ``AsyncScheduler``
(no kvmetrics hook in the path), gives it a :class:`ScriptedConnector` that offers
exactly the external tokens the scenario needs, and plays the worker with
hand-built ``ModelRunnerOutput`` objects, in the style of vLLM's
``tests/v1/kv_connector/unit``. It then asserts the *mechanism* (which block stays
hashed, who reads it, what the reservation holds), not a symptom, and reports
``present`` True or False, or None with a reason when the scenario cannot be run
on this vLLM (its internals moved). ``kvmetrics vllm-check`` runs them all;
docs/vllm-defects.md explains each with vLLM's code lines and the patch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvmetrics.lab.vllm.canary_bench import (
    BLOCK,
    VLLM,
    Bench,
    ScenarioError,
    ScriptedConnector,
    Target,
    bench,
    expect,
    on_target,
    prompt,
    request_status,
)

__all__ = ["BLOCK", "DEFECTS", "P", "VLLM", "Bench", "CanaryResult", "Defect",
           "ScenarioError", "ScriptedConnector", "Target", "bench", "expect", "on_target",
           "prompt", "request_status", "run_all", "run_canary", "vllm_version"]


@dataclass(frozen=True)
class Defect:
    id: str
    summary: str
    upstream: tuple[str, ...]
    check: Callable[[], tuple[bool, str]]


@dataclass
class CanaryResult:
    id: str
    present: bool | None
    summary: str
    upstream: list[str]
    #: What the canary saw (the mechanism), or why it could not run.
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        from kvmetrics.lab.vllm.defect_regimes import SEVERITY

        severity = SEVERITY.get(self.id)
        return {"id": self.id, "present": self.present, "summary": self.summary,
                "upstream": list(self.upstream), "detail": self.detail,
                "severity": severity.as_dict() if severity is not None else None}


# -- the defects ---------------------------------------------------------------------------
#
# Shared shape: request ``a`` has a 64-token prompt (4 blocks of 16) and the
# connector offers its first 48 tokens (3 blocks) as a sync load; the load of its
# block #1 fails.

P = prompt(1_000, 64)


def _failed_sync_load(b: Bench, *extra: tuple[str, list[int]],
                      aborted: tuple[str, ...] = ()) -> tuple[int, dict[str, list[int]]]:
    """Step 1: ``a`` (and ``extra`` requests, admitted right after it) run; a's block #1
    fails. ``aborted`` requests are aborted while the step runs (EngineCore applies
    aborts right before ``update_from_output``, so the failure is processed with them
    already gone). Returns the failed block id and every request's block table of that
    step."""
    b.add("a", P, offer=48)
    for rid, tokens in extra:
        b.add(rid, tokens)
    out = b.sched.schedule()
    expect(out.num_scheduled_tokens.get("a", 0) > 0, "a is scheduled with its sync load")
    tables = {rid: b.blocks(rid) for rid in out.num_scheduled_tokens}
    failed = tables["a"][1]
    expect(b.hashed(failed), "a's blocks are hashed at allocation, before the load ran")
    step = b.execute(out)
    if aborted:
        b.sched.finish_requests(list(aborted), request_status("FINISHED_ABORTED"))
    b.update(step, invalid={failed})
    return failed, tables


def _hit(b: Bench, out: Any, request_id: str) -> tuple[int, list[int]]:
    """A newly admitted request's local hit: its tokens and the blocks they are in."""
    (new,) = [r for r in out.scheduled_new_reqs if r.req_id == request_id]
    return new.num_computed_tokens, list(new.block_ids[0][: new.num_computed_tokens // BLOCK])


def _sharers_prompt_after_a_retry(b: Bench, sharer: list[int],
                                  own: list[int]) -> tuple[int, list[int]]:
    """``e`` computes a's first 33 tokens (caching the failed block #1's hash again, as
    a client retrying a's prompt would), then ``f`` arrives with the sharer's prompt:
    its local hit, and which of the sharer's blocks ``own`` it reads."""
    b.add("e", P[:33], max_tokens=1)
    while not b.requests["e"].is_finished():
        b.step()
    b.add("f", sharer)
    hit, blocks = _hit(b, b.sched.schedule(), "f")
    return hit, sorted(set(blocks) & set(own))


def recompute_keeps_failed_block() -> tuple[bool, str]:
    b = bench("recompute")
    failed, _ = _failed_sync_load(b)
    a = b.requests["a"]
    expect(a.num_computed_tokens == BLOCK, f"a rolled back to 16, not {a.num_computed_tokens}")
    still_hashed = b.hashed(failed)
    b.sched.finish_requests("a", request_status("FINISHED_ABORTED"))  # gone before recomputing
    b.add("c", P)
    hit, blocks = _hit(b, b.sched.schedule(), "c")
    reads = failed in blocks
    detail = (f"block {failed} (a's #1, its load failed) is "
              f"{'still' if still_hashed else 'no longer'} hashed after the rollback; "
              f"a is aborted before recomputing it; c, same prompt, gets a {hit}-token "
              f"local hit that {'includes' if reads else 'stops before'} it")
    return still_hashed and reads, detail


def chunked_recompute_sharer() -> tuple[bool, str]:
    # A chunk limit below the block size: a recomputes its failed block in pieces.
    b = bench("recompute", long_prefill_token_threshold=8)
    failed, tables = _failed_sync_load(b, ("s", P))
    a, s = b.requests["a"], b.requests["s"]
    expect(tables["s"][1] == failed, "s hits a's blocks in the local cache")
    expect(a.num_computed_tokens == BLOCK, f"a rolled back to 16, not {a.num_computed_tokens}")
    out = b.sched.schedule()
    a_end = a.num_computed_tokens
    s_read = s.num_computed_tokens - out.num_scheduled_tokens.get("s", 0)
    reads = "s" in out.num_scheduled_tokens and s_read >= 2 * BLOCK and a_end < 2 * BLOCK
    detail = (f"s shares a's failed block {failed} and kept {s_read} tokens as computed; in "
              f"the next step a recomputes that block only up to token {a_end} of [16, 32) "
              f"while s {'reads' if reads else 'does not read'} all of it")
    return reads, detail


def fail_sharer_blocks_hashed() -> tuple[bool, str]:
    b = bench("fail")
    sharer = P[:32] + prompt(5_000, 32)  # shares a's blocks #0 and #1, then its own two
    failed, tables = _failed_sync_load(b, ("s", sharer))
    expect(tables["s"][1] == failed, "s hits a's blocks in the local cache")
    expect(b.requests["s"].is_finished() and b.requests["a"].is_finished(),
           "a and s end with an error")
    own = tables["s"][2:4]  # computed over the failed block in step 1
    stale = [bid for bid in own if b.hashed(bid)]
    hit, reads = _sharers_prompt_after_a_retry(b, sharer, stale)
    detail = (f"both end with an error; of s's own blocks {own}, computed over a's failed "
              f"block, {stale or 'none'} stay hashed; once e has cached that block's hash "
              f"again, f (s's prompt) gets a {hit}-token local hit "
              f"{'that reads ' + str(reads) if reads else 'reading none of them'}")
    return bool(reads), detail


def async_load_stall() -> tuple[bool, str]:
    """What a user sees: is ``r`` admitted again while the cache has room for it?

    Judged by admission only (``r`` scheduled, or parked again as a new async load),
    with nothing else in the engine, so that no bookkeeping of any vLLM version (0.33's
    in-flight prefills, 0.34's parked reservations) decides the answer."""
    # 6 usable blocks; r needs 4 for its prompt and loads 3 of them asynchronously.
    b = bench("recompute", num_gpu_blocks=7)
    r = b.add("r", P, offer=48, load_async=True)
    out = b.sched.schedule()
    expect(r.status == request_status("WAITING_FOR_REMOTE_KVS"), "r waits for its async load")
    # The transfer reports finished with its first block failed: nothing valid remains.
    b.update(b.execute(out), invalid={b.blocks("r")[0]}, finished_recving={"r"})
    waiting, parked = request_status("WAITING"), request_status("WAITING_FOR_REMOTE_KVS")
    needed = -(-(len(P) + 1) // BLOCK)  # its prompt and the first token it samples
    pool = b.sched.kv_cache_manager.block_pool
    refused: list[int] = []  # free blocks at each step r was refused
    admitted_at = None
    for step in range(1, 6):
        out = b.sched.schedule()
        if "r" in out.num_scheduled_tokens or r.status == parked:
            admitted_at = step
            break
        expect(r.status == waiting and not b.sched.running,
               "r waits alone, nothing else holds blocks")
        refused.append(pool.get_num_free_blocks())  # as this step left the cache
        b.update(b.execute(out))
    stuck = admitted_at is None and min(refused) >= needed
    detail = ("r's async load failed in its first block and its blocks were freed; "
              + (f"r needs {needed} blocks, and with {min(refused)} of {pool.num_gpu_blocks - 1}"
                 f" free and nothing else running it is refused {len(refused)} steps in a "
                 f"row{_reservation(b, r)}"
                 if stuck else
                 f"r is admitted again in step {admitted_at}" if admitted_at is not None else
                 f"r is refused, but with only {min(refused)} blocks free for its {needed}"))
    return stuck, detail


def _reservation(b: Bench, r: Any) -> str:
    """Why, where this vLLM's bookkeeping says (for the reader only: the verdict is
    the refusal above, never this)."""
    sched = b.sched
    if r in getattr(sched, "_parked_reservations", {}):
        return (f" (r's own parked reservation, {sched._parked_reservations[r]} blocks, "
                "counts against it)")
    if r in getattr(sched, "_inflight_prefills", ()):
        return " (r stays an in-flight prefill, so its own reservation counts against it)"
    return ""


def async_rollback_in_flight() -> tuple[bool, str]:
    b = bench("recompute", async_scheduling=True)
    a = b.add("a", P, offer=48)
    s1 = b.sched.schedule()  # a's last prefill chunk: a placeholder for its first token
    e1 = b.execute(s1)
    s2 = b.sched.schedule()  # scheduled before s1's output is known: a decodes
    e2 = b.execute(s2)
    expect(s2.num_scheduled_tokens.get("a") == 1, "a decodes in the step scheduled ahead")
    b.update(e1, invalid={b.blocks("a")[1]})
    expect(a.num_computed_tokens == BLOCK, f"a rolled back to 16, not {a.num_computed_tokens}")
    left = a.num_output_placeholders
    b.update(e2)
    kept = list(a.output_token_ids)
    leftover = a.num_output_placeholders if a.num_in_flight_tokens == 0 else 0
    detail = (f"after the rollback a has {left} output placeholder(s); the output of the "
              f"step already in flight, which decoded over the failed block, is "
              f"{'kept: ' + str(kept) if kept else 'discarded'}; with nothing in flight "
              f"{leftover} placeholder(s) remain"
              + (", so a is scheduled past the tokens it knows" if leftover else ""))
    return bool(kept) or leftover > 0, detail


def async_sharer_in_flight() -> tuple[bool, str]:
    b = bench("recompute", async_scheduling=True)
    b.add("a", P, offer=48)
    s1 = b.sched.schedule()  # step n: a's sync load and its last prefill chunk
    e1 = b.execute(s1)
    c = b.add("c", P)
    s2 = b.sched.schedule()  # step n+1, before step n's output: c hits a's fresh blocks
    failed = b.blocks("a")[1]
    hit, blocks = _hit(b, s2, "c")
    expect(failed in blocks and "c" not in s1.num_scheduled_tokens,
           "c, admitted in step n+1, hits a's freshly loaded blocks")
    e2 = b.execute(s2)  # c's last prefill chunk, computed over the failed block
    b.update(e1, invalid={failed})
    kept_count = c.num_computed_tokens
    b.update(e2)
    kept = list(c.output_token_ids)
    detail = (f"c, admitted in step n+1 with a {hit}-token local hit on a's fresh blocks, "
              f"sampled a token over a's failed block {failed} in step n+1; when step n "
              f"reports the failure c was not in it, so it keeps {kept_count} tokens as "
              f"computed, and its in-flight token is "
              f"{'delivered: ' + str(kept) if kept else 'discarded'}")
    return bool(kept), detail


def aborted_owner_keeps_failed_block() -> tuple[bool, str]:
    owner_reads, owner = _aborted_owner()
    sharer_reads, sharer = _aborted_sharer()
    return owner_reads or sharer_reads, f"{owner}; {sharer}"


def _aborted_owner() -> tuple[bool, str]:
    b = bench("fail")  # vLLM's default policy
    failed, _ = _failed_sync_load(b, aborted=("a",))  # the client leaves during the step
    still_hashed = b.hashed(failed)
    b.add("c", P)
    hit, blocks = _hit(b, b.sched.schedule(), "c")
    reads = failed in blocks
    detail = (f"a is aborted while the step of its sync load runs; the load of its block "
              f"#1 ({failed}) fails; nobody still scheduled holds that block, so it is "
              f"{'still' if still_hashed else 'no longer'} hashed, and c (same prompt) "
              f"gets a {hit}-token local hit that {'includes' if reads else 'stops before'} "
              f"it")
    return still_hashed and reads, detail


def _aborted_sharer() -> tuple[bool, str]:
    """As ``fail_sharer_blocks_hashed``, but the sharer is aborted while the step runs:
    it loaded nothing, and vLLM's scans no longer see it."""
    b = bench("fail")
    sharer = P[:32] + prompt(5_000, 32)
    failed, tables = _failed_sync_load(b, ("s", sharer), aborted=("s",))
    expect(tables["s"][1] == failed, "s hits a's blocks in the local cache")
    own = tables["s"][2:4]
    hit, reads = _sharers_prompt_after_a_retry(b, sharer, own)
    detail = (f"s, sharing a's block #1, is aborted in the same step; of its own blocks "
              f"{own}, computed over the failed one, f (s's prompt, after e cached #1's "
              f"hash again) gets a {hit}-token local hit "
              f"{'that reads ' + str(reads) if reads else 'reading none of them'}")
    return bool(reads), detail


DEFECTS: tuple[Defect, ...] = (
    Defect("recompute-keeps-failed-block",
           "recompute: a failed sync block stays hashed; if its owner is preempted or "
           "aborted before recomputing it, the next request with that prefix reads KV "
           "that was never loaded",
           ("vllm-project/vllm#53298",), recompute_keeps_failed_block),
    Defect("chunked-recompute-sharer",
           "recompute: a sharer of a failed block keeps counting it as computed and reads "
           "it while its owner recomputes it in chunks (no preemption needed)",
           ("vllm-project/vllm#49250", "vllm-project/vllm#53298"), chunked_recompute_sharer),
    Defect("fail-sharer-blocks-hashed",
           "fail: a sharer's own new blocks, computed over the failed block, stay hashed "
           "and are hit once the failed block's hash is cached again",
           (), fail_sharer_blocks_hashed),
    Defect("async-load-stall",
           "an async load that failed in every block frees its blocks but stays an "
           "in-flight prefill, so its own reservation keeps it (and everything queued "
           "behind it) from being admitted again",
           ("vllm-project/vllm#48433", "vllm-project/vllm#57841"), async_load_stall),
    Defect("aborted-owner-keeps-failed-block",
           "either policy (fail is vLLM's default): a request aborted while the step of "
           "its sync load runs (or of a sharer of that load's blocks) is no longer "
           "scanned when the load is reported failed, so nothing evicts the failed block "
           "(or the blocks the sharer computed over it) and the next request with that "
           "prefix reads them",
           (), aborted_owner_keeps_failed_block),
    Defect("async-rollback-in-flight",
           "async scheduling: the rollback leaves the request's output placeholders and "
           "keeps the output of the step already scheduled over the failed block",
           ("vllm-project/vllm#45138", "vllm-project/vllm#45146", "vllm-project/vllm#49252",
            "vllm-project/vllm#53298", "vllm-project/vllm#56733"), async_rollback_in_flight),
    Defect("async-sharer-in-flight",
           "async scheduling: a request admitted in the step after a sync load, with a "
           "local hit on the freshly loaded blocks, is not rolled back when a block fails "
           "and its token computed over the failed block is delivered",
           ("vllm-project/vllm#19330", "vllm-project/vllm#53298", "vllm-project/vllm#56733"),
           async_sharer_in_flight),
)


def run_canary(defect: Defect) -> CanaryResult:
    result = CanaryResult(defect.id, None, defect.summary, list(defect.upstream))
    try:
        result.present, result.detail = defect.check()
    except Exception as e:  # changed internals: say so, never crash the check
        result.detail = f"could not run on this vLLM: {type(e).__name__}: {e}".splitlines()[0]
    return result


def run_all(ids: Iterable[str] | None = None, target: Target = VLLM) -> list[CanaryResult]:
    wanted = set(ids) if ids is not None else None
    with on_target(target):
        return [run_canary(d) for d in DEFECTS if wanted is None or d.id in wanted]


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))
