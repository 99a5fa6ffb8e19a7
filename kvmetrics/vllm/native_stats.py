"""vLLM's own KV-load failure figures, where a vLLM has them, checked against kvmetrics'.

A vLLM carrying ``docs/vllm-patches/0005`` reports, in every step's ``SchedulerStats``
(with statistics logging on), ``kv_load_failure_stats``: failed blocks, failed
requests, rolled-back tokens and recomputed tokens since the previous step's stats,
each counted where vLLM handles the event. They are the same four figures kvmetrics
counts from its hooks, over the same window: vLLM makes the stats inside
``update_from_output`` and kvmetrics closes its step right after it, both having seen
the same ``schedule`` call before (with async scheduling, the next step's). So the
sums must be equal at every recorded step; a difference is counted in
``kvmetrics_self_check_failures_total{check="vllm_kv_load_stats"}`` and logged once.

Stock vLLM (0.28 to 0.34) has no such field: after the first step's stats show it,
nothing here runs per step there. A
vLLM whose stats cannot be read as expected counts one failure of the check, logs it
and stops comparing (an unknown is never a pass).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import StepEvents
from kvmetrics.vllm.exporting import LOGGER

if TYPE_CHECKING:
    from kvmetrics.vllm.state import InstrumentState

log = logging.getLogger(LOGGER)

#: The label of ``kvmetrics_self_check_failures_total`` this comparison counts under.
CHECK = "vllm_kv_load_stats"
#: vLLM's fields, in the order of :data:`FAMILIES`.
FIELDS = ("failed_blocks", "failed_requests", "rolled_back_tokens", "recomputed_tokens")
#: kvmetrics' family for each field, and the label values (by position in the family's
#: labels; None: any) an increment must have to count.
FAMILIES: tuple[tuple[cat.MetricSpec, tuple[str | None, ...]], ...] = (
    (cat.KV_LOAD_BLOCKS, (None, "failed")),
    (cat.KV_LOAD_FAILED_REQUESTS, ()),
    (cat.ROLLED_BACK_TOKENS, ()),
    (cat.RECOMPUTED_TOKENS, ("kv_load_failure",)),
)


def available(scheduler: Any) -> bool:
    """Whether this scheduler makes stats (``log_stats``) with a KV connector: then its
    first step's stats say whether this vLLM has the figures (:func:`add_step`). Told
    from the stats themselves, not by importing vLLM's stats module, whose code would
    then join the fingerprinted set."""
    return (bool(getattr(scheduler, "log_stats", False))
            and getattr(scheduler, "connector", None) is not None)


def add_step(kv: InstrumentState, outputs: Any) -> None:
    """Add one step's figures (from ``update_from_output``'s result) to those not yet
    compared; a step with any makes kvmetrics record it. A vLLM whose stats have no
    such field (every release to 0.34) is not read again."""
    figures = _read(outputs)
    if figures is None:
        kv.native_load = False
        return
    pending = kv.native_sum
    if pending is None:
        kv.native_sum = figures
    else:
        kv.native_sum = [a + b for a, b in zip(pending, figures, strict=True)]
    if any(figures):
        kv.must_record = True


def _read(outputs: Any) -> list[int] | None:
    """The step's four figures; None when vLLM's stats have no such field."""
    for eco in outputs.values():
        stats = eco.scheduler_stats
        if stats is not None:
            if not hasattr(stats, "kv_load_failure_stats"):
                return None
            figures = stats.kv_load_failure_stats
            if figures is None:
                return [0, 0, 0, 0]
            values = [getattr(figures, name) for name in FIELDS]
            if not all(type(v) is int and v >= 0 for v in values):
                raise ValueError(f"vLLM's kv_load_failure_stats holds {values!r}")
            return values
    return [0, 0, 0, 0]  # no stats this step (vLLM makes them on every step it logs)


def compare(kv: InstrumentState, events: StepEvents) -> None:
    """Compare the figures since the last recorded step with this step's increments
    (or count the failure to read them, once)."""
    if kv.native_unread:
        kv.native_unread = False
        events.count(cat.SELF_CHECK_FAILURES, 1, CHECK)
    theirs, kv.native_sum = kv.native_sum, None
    if theirs is None:
        return
    ours = [0.0] * len(FAMILIES)
    for inc in events.increments:
        for i, (spec, wanted) in enumerate(FAMILIES):
            if inc.spec is spec and all(w is None or w == v
                                        for w, v in zip(wanted, inc.label_values,
                                                        strict=False)):
                ours[i] += inc.amount
    # vLLM counts no block of a load a connector failed whole (docs/metrics.md).
    ours[0] -= events.whole_load_failed_blocks
    # A family whose hook is off is absent from the page: nothing of it to compare.
    shown = [spec.name not in kv.disabled for spec, _ in FAMILIES]
    if [o for o, s in zip(ours, shown, strict=True) if s] == \
            [t for t, s in zip(theirs, shown, strict=True) if s]:
        return
    events.count(cat.SELF_CHECK_FAILURES, 1, CHECK)
    kv.self_checks.log_once(CHECK, dict(zip(FIELDS, ours, strict=True)),
                            dict(zip(FIELDS, theirs, strict=True)))


def give_up(kv: InstrumentState) -> None:
    """Stop comparing after vLLM's figures could not be read: one failure counted (with
    the next recorded step), the reason logged."""
    kv.native_load = False
    kv.native_sum = None
    kv.native_unread = True
    kv.must_record = True
    with contextlib.suppress(Exception):  # called on vLLM's call path: never raises
        log.exception("kvmetrics: vLLM's kv_load_failure_stats could not be read; the "
                      "check %s stops (counted as one failure)", CHECK)
