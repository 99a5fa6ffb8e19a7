"""Per-step invariants of the design brief, checked on events and running totals.

A break is reported as ``kind=invariant`` on the metric it concerns. The checks
only read what the step reported and the accepted totals, so they work the same
for the reference engine and for vLLM's scheduler.
"""

from __future__ import annotations

from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import StepEvents
from kvmetrics.metrics.guard import Violation
from kvmetrics.metrics.totals import Totals


class InvariantChecker:
    """Keeps the little state the cumulative invariants need between steps."""

    def __init__(self) -> None:
        self._discarded_tokens = 0
        self._recompute_excess = 0.0
        self._previous: dict[tuple[str, tuple[str, ...]], float] = {}

    def check(self, events: StepEvents, totals: Totals) -> list[Violation]:
        found: list[Violation] = []
        step = events.step

        def broken(spec: cat.MetricSpec, detail: str, request_id: str | None = None) -> None:
            found.append(Violation(spec.name, "invariant", step, detail, request_id))

        for source in cat.SOURCE:
            queried = totals.get(cat.PREFIX_CACHE_QUERY_TOKENS, source=source)
            hit = totals.get(cat.PREFIX_CACHE_HIT_TOKENS, source=source)
            if hit > queried:
                broken(cat.PREFIX_CACHE_HIT_TOKENS,
                       f"{source} hits {hit:g} exceed queries {queried:g}")

        pool = events.pool
        if pool is not None:
            if pool.free_blocks + pool.used_blocks != pool.total_blocks:
                broken(cat.KV_CACHE_USAGE,
                       f"free {pool.free_blocks} + used {pool.used_blocks} "
                       f"!= total {pool.total_blocks}")
            if pool.negative_ref_counts:
                broken(cat.KV_CACHE_USAGE,
                       f"{pool.negative_ref_counts} block reference counts went negative")

        for rb in events.rollbacks:
            if not 0 <= rb.computed_after <= rb.computed_before:
                broken(cat.ROLLED_BACK_TOKENS,
                       f"rolled back from {rb.computed_before} to {rb.computed_after}",
                       rb.request_id)

        self._discarded_tokens += events.discarded_tokens
        recomputed = totals.get(cat.RECOMPUTED_TOKENS, cause="kv_load_failure")
        rolled_back = totals.get(cat.ROLLED_BACK_TOKENS)
        excess = recomputed - rolled_back - self._discarded_tokens
        if excess > self._recompute_excess:
            # Cumulative: report a breach when it appears or grows, not every step after.
            broken(cat.RECOMPUTED_TOKENS,
                   f"recomputed after load failures {recomputed:g} > rolled back "
                   f"{rolled_back:g} + discarded {self._discarded_tokens}")
        self._recompute_excess = max(self._recompute_excess, excess)

        current = totals.series()
        for key, before in self._previous.items():
            if current.get(key, 0.0) < before:
                broken(cat.spec(key[0]), f"series {key[1]} went from {before:g} "
                       f"to {current.get(key, 0.0):g}")
        self._previous = current
        return found
