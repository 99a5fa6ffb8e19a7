"""Requests as the scheduler sees them: tokens, progress, status and block hashes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvmetrics.lab.engine.hashing import ROOT_HASH, BlockHash, hash_block
from kvmetrics.lab.engine.tokens import PromptTokens, output_key


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stopped"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "aborted"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED_")

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: PromptTokens
    max_tokens: int
    #: A sampled token equal to this stops the request (finish reason "stopped").
    eos_token_id: int | None = None
    cache_salt: str | None = None
    arrival_step: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)

    #: Highest ``num_computed_tokens`` ever reached: tokens below it that are
    #: scheduled again are *recomputed*, and counted as such.
    computed_high_water: int = 0
    #: Tokens below this mark that are scheduled again are recomputed because a
    #: KV load failed (the computed count just before the last rollback); those
    #: above it, up to the high-water mark, were lost to preemption.
    kv_failure_until: int = 0
    #: Mode of the connector load this request is waiting for or ran last step.
    load_mode: str | None = None
    #: Prefix lookups done so far (the first is admission "first").
    num_lookups: int = 0
    #: Unified accounting: prompt tokens by source are recorded once.
    prefill_stats_recorded: bool = False

    # Async scheduling (vLLM's AsyncScheduler and batch queue), same names as vLLM's.
    #: Tokens a decode step in flight will sample: already counted in
    #: ``num_computed_tokens``, not yet in ``output_token_ids``.
    num_output_placeholders: int = 0
    #: Scheduled tokens of steps whose output has not been processed yet.
    num_in_flight_tokens: int = 0
    #: Of those, tokens whose output must leave the request's counts alone (it was
    #: preempted, or rolled back, while they were in flight).
    num_stale_output_tokens: int = 0
    #: Discard that stale output instead of appending its tokens.
    drop_stale_output: bool = False
    #: Sequence number of the last non-empty step it was scheduled in (deferred frees).
    last_sched_seq: int = 0

    # Historical accounting fields, kept exactly as the old vLLM code kept them.
    num_cached_tokens: int = -1
    num_external_computed_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def content_key(self, start: int, end: int) -> bytes:
        p = len(self.prompt)
        if end <= p:
            return self.prompt.content_key(start, end)
        if start >= p:
            return output_key(self.output_token_ids[start - p:end - p])
        return (self.prompt.content_key(start, p)
                + output_key(self.output_token_ids[: end - p]))

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt)
        head = self.prompt.tokens(start, min(end, p)) if start < p else []
        tail = self.output_token_ids[max(start - p, 0): max(end - p, 0)]
        return head + tail

    def update_block_hashes(self, block_size: int) -> None:
        """Hash every block that has become full since the last call."""
        n_full = self.num_tokens // block_size
        while len(self.block_hashes) < n_full:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
            extra = self.cache_salt.encode() if (i == 0 and self.cache_salt) else b""
            self.block_hashes.append(
                hash_block(parent, self.content_key(i * block_size, (i + 1) * block_size), extra))
