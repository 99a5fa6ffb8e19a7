"""What one scheduler step did, as engine-agnostic events.

An engine (the reference scheduler, or the vLLM wrapper) fills a :class:`StepEvents`
while it runs a step. Every counter increment is a *count of something that
happened in this step* (tokens looked up, blocks evicted, tokens rolled back),
never a difference of request fields that are updated at different times: that
subtraction is how the upstream prefix-cache accounting went negative.

The only exception on purpose is the ``historical`` accounting of the reference
engine, which reproduces the old formula so the guard has something real to catch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.catalogue import MetricSpec


@dataclass(slots=True)
class CounterIncrement:
    """One increment of one labelled counter series, with its cause for the logs."""

    spec: MetricSpec
    amount: float
    #: Values of ``spec.labels`` in declaration order (common labels are added by
    #: the pipeline; they are the same for every increment of an engine).
    label_values: tuple[str, ...] = ()
    request_id: str | None = None


@dataclass(slots=True)
class GaugeReadings:
    """Point-in-time state at the end of a step."""

    kv_cache_usage: float
    running: int
    waiting: int
    waiting_for_remote_kv: int
    #: Blocks the engine can allocate (its cache size; block 0 is reserved).
    cache_blocks: int

    def samples(self) -> list[tuple[MetricSpec, tuple[str, ...], float]]:
        """Each gauge series as (family, its own label values, value): one list for all sinks."""
        return [
            (cat.KV_CACHE_USAGE, (), self.kv_cache_usage),
            (cat.KV_CACHE_BLOCKS, (), self.cache_blocks),
            (cat.REQUESTS, ("running",), self.running),
            (cat.REQUESTS, ("waiting",), self.waiting),
            (cat.REQUESTS, ("waiting_for_remote_kv",), self.waiting_for_remote_kv),
        ]


@dataclass(slots=True)
class PoolSnapshot:
    """Block accounting at the end of a step, for the pool invariants."""

    free_blocks: int
    used_blocks: int
    total_blocks: int
    negative_ref_counts: int


@dataclass(slots=True)
class Rollback:
    """One request truncated by the recovery path (for the rollback invariant)."""

    request_id: str
    computed_before: int
    computed_after: int


@dataclass(slots=True)
class StepEvents:
    """Everything the metrics layer needs to know about one scheduler step."""

    step: int
    increments: list[CounterIncrement] = field(default_factory=list)
    gauges: GaugeReadings | None = None
    pool: PoolSnapshot | None = None
    #: Seconds spent in the recovery path, if it ran in this step.
    recovery_seconds: float | None = None
    rollbacks: list[Rollback] = field(default_factory=list)
    #: Tokens scheduled in the failed step whose output the recovery path threw
    #: away; they are recomputed later and so bound the recompute invariant.
    discarded_tokens: int = 0
    #: Of the failed blocks counted, those of loads a connector failed whole
    #: (``failed_recving``): vLLM's own failed-block figure leaves them out.
    whole_load_failed_blocks: int = 0

    # -- helpers that keep label order and names in one place -----------------

    def count(
        self,
        spec: MetricSpec,
        amount: float,
        *label_values: str,
        request_id: str | None = None,
    ) -> None:
        """Record an increment; zero amounts are dropped to keep the list short.

        Never raises: an amount that cannot even be compared with zero (an array, a
        signalling ``Decimal``) is recorded as it is, for the guard to refuse and count."""
        try:
            if amount == 0:
                return
        except Exception:
            pass
        self.increments.append(CounterIncrement(spec, amount, label_values, request_id))

    def prefix_lookup(
        self, source: str, admission: str, queried: int, hit: int, request_id: str
    ) -> None:
        self.count(cat.PREFIX_CACHE_QUERY_TOKENS, queried, source, admission,
                   request_id=request_id)
        self.count(cat.PREFIX_CACHE_HIT_TOKENS, hit, source, admission, request_id=request_id)

    def prompt_tokens(self, source: str, amount: int, request_id: str) -> None:
        self.count(cat.PROMPT_TOKENS, amount, source, request_id=request_id)

    def loaded_blocks(self, mode: str, ok: int, failed: int, whole_load: bool = False) -> None:
        self.count(cat.KV_LOAD_BLOCKS, ok, mode, "ok")
        self.count(cat.KV_LOAD_BLOCKS, failed, mode, "failed")
        if whole_load:
            self.whole_load_failed_blocks += failed

    def failed_load_request(self, mode: str, policy: str, action: str, request_id: str) -> None:
        self.count(cat.KV_LOAD_FAILED_REQUESTS, 1, mode, policy, action, request_id=request_id)

    def rolled_back(
        self, mode: str, policy: str, request_id: str, computed_before: int, computed_after: int
    ) -> None:
        self.rollbacks.append(Rollback(request_id, computed_before, computed_after))
        self.count(cat.ROLLED_BACK_TOKENS, computed_before - computed_after, mode, policy,
                   request_id=request_id)

    def recomputed(self, cause: str, amount: int, request_id: str) -> None:
        self.count(cat.RECOMPUTED_TOKENS, amount, cause, request_id=request_id)

    def evicted(self, cause: str, blocks: int) -> None:
        self.count(cat.EVICTED_BLOCKS, blocks, cause)

    def preempted(self, request_id: str) -> None:
        self.count(cat.PREEMPTIONS, 1, request_id=request_id)

    def finished(self, reason: str, request_id: str) -> None:
        self.count(cat.FINISHED_REQUESTS, 1, reason, request_id=request_id)

    def verified(self, tokens: int, failed_blocks: int) -> None:
        self.count(cat.KV_VERIFIED_TOKENS, tokens)
        self.count(cat.KV_VERIFICATION_FAILED_BLOCKS, failed_blocks)

    def merge(self, other: StepEvents) -> None:
        """Fold another fragment of the same step in (e.g. the data plane's part)."""
        self.increments.extend(other.increments)
        self.rollbacks.extend(other.rollbacks)
        self.discarded_tokens += other.discarded_tokens
        if other.gauges is not None:
            self.gauges = other.gauges
        if other.pool is not None:
            self.pool = other.pool
        if other.recovery_seconds is not None:
            self.recovery_seconds = (self.recovery_seconds or 0.0) + other.recovery_seconds
