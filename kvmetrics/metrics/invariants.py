"""Per-step invariants of the design brief, checked on events and accepted increments.

A break is reported with the invariant's catalogue name (``cat.INVARIANTS``) and
the metric it concerns, and counted in ``kvmetrics_invariant_violations_total``. The checker
keeps its own running sums, fed with every increment the pipeline accepts, so a
step costs O(increments of that step), not O(series). It only reads what steps
report, so it works the same for the reference engine and for vLLM's scheduler.
"""

from __future__ import annotations

from collections import defaultdict

from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import StepEvents
from kvmetrics.metrics.guard import Violation

_QUERIES = cat.PREFIX_CACHE_QUERY_TOKENS.name
_HITS = cat.PREFIX_CACHE_HIT_TOKENS.name
_RECOMPUTED = cat.RECOMPUTED_TOKENS.name
_ROLLED_BACK = cat.ROLLED_BACK_TOKENS.name


class InvariantChecker:
    def __init__(self) -> None:
        self._queries: dict[str, float] = defaultdict(float)
        self._hits: dict[str, float] = defaultdict(float)
        self._recomputed_after_failure = 0.0
        self._rolled_back = 0.0
        self._discarded_tokens = 0
        self._recompute_excess = 0.0
        self._series: dict[tuple[str, tuple[str, ...]], float] = defaultdict(float)
        self._decreased: list[tuple[str, tuple[str, ...], float, float]] = []
        #: Whether a sum changed since the last check (most decode steps: no).
        self._dirty = False

    def observe(self, spec: cat.MetricSpec, values: tuple[str, ...], amount: float,
                exported_total: float) -> None:
        """Called for every accepted increment with the series' new exported total."""
        name = spec.name
        key = (name, values)
        before = self._series[key]
        if exported_total < before:
            self._decreased.append((name, values, before, exported_total))
        self._series[key] = exported_total
        self._dirty = True
        first = values[0] if values else ""  # a label-less series: never raises
        if name == _QUERIES:
            self._queries[first] += amount
        elif name == _HITS:
            self._hits[first] += amount
        elif name == _RECOMPUTED:
            if first == "kv_load_failure":
                self._recomputed_after_failure += amount
        elif name == _ROLLED_BACK:
            self._rolled_back += amount

    def check(self, events: StepEvents) -> list[Violation]:
        found: list[Violation] = []
        step = events.step

        def broken(invariant: str, spec: cat.MetricSpec, detail: str,
                   request_id: str | None = None) -> None:
            found.append(Violation(spec.name, "invariant", step, detail, request_id,
                                   invariant=invariant))

        dirty = self._dirty or events.discarded_tokens
        self._dirty = False
        if dirty:
            for source, hit in self._hits.items():
                queried = self._queries[source]
                if hit > queried:
                    broken("hits_within_queries", cat.PREFIX_CACHE_HIT_TOKENS,
                           f"{source} hits {hit:g} exceed queries {queried:g}")

        pool = events.pool
        if pool is not None:
            if pool.free_blocks + pool.used_blocks != pool.total_blocks:
                broken("pool_blocks_balance", cat.KV_CACHE_USAGE,
                       f"free {pool.free_blocks} + used {pool.used_blocks} "
                       f"!= total {pool.total_blocks}")
            if pool.negative_ref_counts:
                broken("ref_counts_non_negative", cat.KV_CACHE_USAGE,
                       f"{pool.negative_ref_counts} block reference counts went negative")

        for rb in events.rollbacks:
            if not 0 <= rb.computed_after <= rb.computed_before:
                broken("rollback_within_computed", cat.ROLLED_BACK_TOKENS,
                       f"rolled back from {rb.computed_before} to {rb.computed_after}",
                       rb.request_id)

        if dirty:
            self._discarded_tokens += events.discarded_tokens
            excess = self._recomputed_after_failure - self._rolled_back - self._discarded_tokens
            if excess > self._recompute_excess:
                # Cumulative: report a breach when it appears or grows, not every step.
                broken("recompute_within_rollback", cat.RECOMPUTED_TOKENS,
                       f"recomputed after load failures {self._recomputed_after_failure:g} > "
                       f"rolled back {self._rolled_back:g} + discarded "
                       f"{self._discarded_tokens}")
            self._recompute_excess = max(self._recompute_excess, excess)

        if self._decreased:
            for name, values, before, after in self._decreased:
                broken("counters_monotonic", cat.spec(name),
                       f"series {values} went from {before:g} to {after:g}")
            self._decreased.clear()
        return found
