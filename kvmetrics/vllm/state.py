"""The instrumented scheduler's state, in one object with one owner.

Everything kvmetrics keeps about a scheduler lives in one :class:`InstrumentState`,
``scheduler._kv``: what the recorder accumulates (its base class,
:class:`~.recorder.StepRecorder`) and what the overrides, the step end and the hooks'
fault policy keep. Each field is set once, in ``__init__``, with its meaning. The hooks
reach the recorder's methods through this object (``kv.lookup(...)``), never by name.

A quiet step reads a handful of these slots (``step`` and the periods beside it,
``next_schedule``, ``next_update``, ``output_off``, ``pipeline`` and the recorder's
three flags) through one lookup of ``_kv`` on the scheduler: slots of one object, not
entries of vLLM's scheduler's large instance dict.

The fault policy is here too (:meth:`InstrumentState.fault`, :meth:`disable`): a hook
found unusable at construction and a hook that raises at run time take the same path.
It is turned off, its families join ``disabled`` (left off the page by the pipeline:
``newly_absent`` is handed to it with the next recorded step), it is counted in
``kvmetrics_instrumentation_errors_total{hook}`` and logged once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvmetrics.metrics.events import StepEvents
from kvmetrics.vllm import hooks, owncost
from kvmetrics.vllm.exporting import LOGGER
from kvmetrics.vllm.recorder import StepRecorder
from kvmetrics.vllm.selfcheck import SelfChecks

if TYPE_CHECKING:
    from kvmetrics.metrics.pipeline import MetricsPipeline

log = logging.getLogger(LOGGER)

SCHEDULE_HOOK = "scheduler.schedule"
OUTPUT_HOOK = "scheduler.update_from_output"
#: The gauges' reads of vLLM's queues and pool are one unit, gated by the attribute
#: that names the queue of requests holding KV: a fault in any of them is counted
#: under that attribute, whose families are exactly the gauges.
GAUGES_HOOK = hooks.HOLDING_WAITING.name


class InstrumentState(StepRecorder):
    """The recorder plus the scheduler's own kvmetrics state (see the module)."""

    # The words the quiet step reads first, together.
    __slots__ = ("step", "sample_every", "sample_phase", "gauge_every", "next_schedule",
                 "next_update", "output_off", "pipeline", "cpu_ns", "clock_ns",
                 "counted_cpu_ns", "off", "disabled", "newly_absent", "errors", "logged",
                 "holding_attr", "ready", "self_checks", "read_gap_ns", "read_next_ns",
                 "cpu_report_next_ns", "cpu_alone_ns", "audit_every", "audit_next",
                 "charged_step", "charged_evict_calls", "samples", "cal", "recovery_tally",
                 "native_load", "native_sum", "native_unread")

    def __init__(self, block_size: int, policy: str, has_connector: bool) -> None:
        super().__init__(block_size, policy, has_connector)
        #: Steps whose output was processed (``update_from_output`` calls).
        self.step = 0
        #: A step whose count is ``sample_phase`` modulo ``sample_every`` has its inline
        #: code timed in place (owncost); one whose new count is a multiple of
        #: ``gauge_every`` (step_end.GAUGE_EVERY, set by the scheduler) reads the gauges
        #: if they are due. Slots beside ``step``, not module globals: the quiet step
        #: touches no module's dict.
        self.sample_every = owncost.SAMPLE_EVERY
        self.sample_phase = owncost.SAMPLE_PHASE
        self.gauge_every = 1
        #: vLLM's ``schedule`` / ``update_from_output`` functions the overrides call
        #: directly (resolved once at construction); None: through ``super()``.
        self.next_schedule: Any = None
        self.next_update: Any = None
        #: ``update_from_output`` is off: the override only calls vLLM.
        self.output_off = False
        #: The pipeline that records the steps; None: they wait in ``ready``.
        self.pipeline: MetricsPipeline | None = None
        #: kvmetrics' own CPU time not yet reported (ns, an estimate: owncost), and
        #: the total reported (``kvmetrics_instrumentation_cpu_seconds_total``).
        self.cpu_ns: float = 0
        self.counted_cpu_ns: float = 0
        #: One thread-clock read (owncost.Calibration.clock_ns): a timed interval
        #: sees one of its two reads, the other is added.
        self.clock_ns = 0
        #: The calibration of the estimate, and the in-place samples of the quiet step.
        self.cal = owncost.Calibration()
        self.samples = owncost.QuietSamples()
        #: The step and eviction-wrapper call counts the estimate was charged up to.
        self.charged_step = 0
        self.charged_evict_calls = 0
        #: Hooks turned off (unusable at construction, or faulted at run time).
        self.off: set[str] = set()
        #: Families left off the page, and those the pipeline has not dropped yet.
        self.disabled: frozenset[str] = frozenset()
        self.newly_absent: set[str] = set()
        #: Hook faults not yet recorded, and the hooks already logged.
        self.errors: dict[str, int] = {}
        self.logged: set[str] = set()
        #: vLLM's name for the queue of requests holding KV while it arrives; None
        #: when the gauges are off.
        self.holding_attr: str | None = None
        #: Recorded steps waiting for ``drain_events`` (no pipeline).
        self.ready: list[StepEvents] = []
        #: The request gauges from vLLM's accessor, checked against kvmetrics' count.
        self.self_checks = SelfChecks()
        #: When (``time.monotonic_ns``) the next periodic gauge read is due, and the
        #: least time between two (step_end.GAUGE_MIN_INTERVAL_S in ns).
        self.read_next_ns = 0
        self.read_gap_ns = 0
        #: When the CPU estimate may next be reported (step_end.CPU_REPORT_MIN_INTERVAL_S).
        self.cpu_report_next_ns = 0
        #: How long after that a report comes without a step that counts something else
        #: (step_end.CPU_REPORT_ALONE_S); 0 until the first report.
        self.cpu_alone_ns = 0
        #: The recovery call running, cross-checked with vLLM's count (recovery_check).
        self.recovery_tally: Any = None
        #: Steps between two pool audits, and the first step the next one may run at.
        self.audit_every = 1
        self.audit_next = 1
        #: This vLLM reports its own KV-load failure figures (native_stats): they are
        #: read every step, summed until the next recorded step and compared there.
        self.native_load = False
        self.native_sum: list[int] | None = None
        #: Reading them failed: one check failure to count with the next recorded step.
        self.native_unread = False

    def timed(self, ns: int) -> None:
        """Count a timed call: its interval plus the clock read the interval missed."""
        self.cpu_ns += ns + self.clock_ns

    def fault(self, hook: str, problem: str | None = None, turn_off: bool = True) -> None:
        """``hook`` cannot be used (``problem``, at construction) or raised (the
        exception being handled): count it, log its first fault, turn it off (unless
        ``turn_off`` is False: a drift that lost nothing, see step_end). A hook already
        off is not counted again: its families are off the page, its fault on record."""
        if hook in self.off:
            return
        self.errors[hook] = self.errors.get(hook, 0) + 1
        self.must_record = True  # reported with this step
        families = self.disable(hook) if turn_off else frozenset()
        if hook in self.logged:
            return
        self.logged.add(hook)
        left_off = ", ".join(sorted(families)) or "nothing"
        if not turn_off:
            log.warning("kvmetrics: a step with events was not flagged for recording "
                        "(StepRecorder.must_record); recorded late, at step %d", self.step)
        elif problem is not None:
            log.warning("kvmetrics: vLLM hook %s unusable (%s); left off the metrics page: %s",
                        hook, problem, left_off)
        else:
            log.exception("kvmetrics hook %s failed; it is off from now on and left off the "
                          "metrics page: %s", hook, left_off)

    def disable(self, hook: str) -> frozenset[str]:
        """Turn ``hook`` off; the families that depend on it (returned) leave the page."""
        if hook == OUTPUT_HOOK:
            # Nothing is recorded without it: every hook stops, nothing accumulates.
            self.output_off = True
            self.off.update(h.name for h in hooks.HOOKS)
        self.off.add(hook)
        if hook == SCHEDULE_HOOK:
            self.schedule_hooked = False
            self.new_loads, self.redo, self.schedule_work = [], {}, False
        families = hooks.disabled_families({hook})
        if families - self.disabled:
            self.newly_absent |= families - self.disabled
            self.disabled |= families
        if self.disabled & set(hooks.GAUGE_FAMILIES):
            self.holding_attr = None
        return families
