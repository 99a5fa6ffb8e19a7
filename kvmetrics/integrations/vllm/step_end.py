"""The end of a step the instrumented scheduler records: events, gauges, own CPU time.

Most decode steps record nothing (:class:`~.scheduler.InstrumentedMixin`'s
``update_from_output`` tests that inline); a step that did something, and every
GAUGE_EVERY-th step, comes here: on the latter only the time is read unless the gauges
are due. A recorded step's events are taken, vLLM's gauges read (with the self-checks,
and now and then the pool audit), the CPU estimate reported when due, and the step
handed to the pipeline (or kept for ``drain_events`` when there is none).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import monotonic_ns, thread_time_ns
from typing import Any

from kvmetrics.integrations.vllm import owncost
from kvmetrics.integrations.vllm.exporting import LOGGER
from kvmetrics.integrations.vllm.recorder import StepRecorder
from kvmetrics.integrations.vllm.selfcheck import SelfChecks
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import PoolSnapshot, StepEvents
from kvmetrics.metrics.guard import CounterViolationError
from kvmetrics.metrics.pipeline import MetricsPipeline

log = logging.getLogger(LOGGER)

#: The pool audit walks every block (O(blocks)), so it runs on every step that ran the
#: recovery path and otherwise with the first gauge read once
#: ``max(POOL_AUDIT_EVERY, blocks // POOL_AUDIT_BLOCKS)`` steps have passed since the
#: last: at most POOL_AUDIT_BLOCKS blocks walked per step, whatever the cache size. A
#: pool inconsistency that persists (a leaked block, a negative reference count) is
#: seen within that many steps plus one gauge interval; one that appears and heals
#: between two audits away from the recovery path is not.
POOL_AUDIT_EVERY = 1024
POOL_AUDIT_BLOCKS = 8

#: With a pipeline (as under ``vllm serve``), a step where nothing happened (no
#: admission, load, preemption, finish or fault) records nothing; its evictions are
#: counted with the next step recorded. The gauges are read on every step that
#: recorded something and, between those, on a GAUGE_EVERY-th step once
#: GAUGE_MIN_INTERVAL_S has passed since the last read: so they lag vLLM by the longer
#: of GAUGE_EVERY steps and GAUGE_MIN_INTERVAL_S (far below a scrape interval), and on a
#: fast CPU-only scheduler (a few hundred microseconds a step) the reads are 0.25 s
#: apart, not 32 steps. Without a pipeline (the lab's drained events) every step is
#: handed on with its gauges, as before.
#:
#: Why on the scheduler thread, not at scrape time on the endpoint's thread: a reading
#: is several reads of vLLM's queues and block pool (the request counts, the requests
#: whose KV is arriving, the cache usage, the self-checks that compare two of them, the
#: pool audit) that must see one state. vLLM's scheduler is single-threaded and mutates
#: those structures without a lock; the GIL makes one ``len()`` atomic, not a sequence
#: of them, and iterating a deque the scheduler appends to raises. So the scheduler
#: thread reads them between two of its own steps and publishes the readings as one
#: immutable snapshot (``GaugeReadings``), which the scrape reads (``PrometheusSink``
#: keeps the latest per engine); multiprocess files and OTLP pushes, which have no
#: scrape in this process, get the same snapshot. The time floor is what reading "at
#: scrape time" would buy: a read costs 50-190 us in a real step (its code and data are
#: cold by then; 5 us in a warm loop), so its cost is bounded per second, not per step.
GAUGE_EVERY = 32
GAUGE_MIN_INTERVAL_S = 0.25

_OUTPUT_HOOK = "scheduler.update_from_output"


class StepEnd:
    """Recording a step, and kvmetrics' own CPU estimate; part of ``InstrumentedMixin``."""

    kvmetrics_pipeline: MetricsPipeline | None
    kvmetrics_cpu_ns: float
    _kv: StepRecorder
    _kv_cpu_ns: float
    _kv_clock_ns: int
    _kv_cal: owncost.Calibration
    _kv_samples: owncost.QuietSamples
    _kv_step: int
    _kv_charged_step: int
    _kv_charged_evict_calls: int
    _kv_disabled: frozenset[str]
    _kv_errors: dict[str, int]
    _kv_ready: list[StepEvents]
    _kv_holding_attr: str | None
    _kv_self_checks: SelfChecks
    _kv_audit_every: int
    #: The first step the next audit may run at.
    _kv_audit_next: int
    #: When (``time.monotonic_ns``) the next periodic gauge read and CPU report are due,
    #: and GAUGE_MIN_INTERVAL_S in nanoseconds.
    _kv_read_next_ns: int
    _kv_read_gap_ns: int
    #: EventHooks' (the fault policy, and counting what is timed every time).
    _kv_hook_failed: Callable[[str], None]
    _kv_timed: Callable[[int], None]

    # -- kvmetrics' own CPU time (owncost) ---------------------------------------------

    def _kv_uncharged_ns(self) -> tuple[float, int, int]:
        """The estimated cost of what is never timed (the quiet part of every step,
        sampled in place; the eviction wrapper, calibrated) since the last charge, and
        the step and wrapper-call counts to it."""
        step, calls = self._kv_step, self._kv.evict_calls
        return (self._kv_samples.step_ns() * (step - self._kv_charged_step)
                + self._kv_cal.evict_ns * (calls - self._kv_charged_evict_calls), step, calls)

    def _kv_sampled(self, part: int, ns: int, intervals: int) -> None:
        """A timing of the quiet step's inline ``part`` (owncost, part 2)."""
        try:
            self._kv_samples.add(part, ns, intervals)
        except Exception:
            self._kv_hook_failed(_OUTPUT_HOOK)

    def _kv_charge(self) -> None:
        """Add the calibrated cost of what is never timed, up to now."""
        ns, self._kv_charged_step, self._kv_charged_evict_calls = self._kv_uncharged_ns()
        self._kv_cpu_ns += ns

    @property
    def kvmetrics_cpu_seconds(self) -> float:
        """kvmetrics' own thread CPU time in this scheduler since it was built (estimate)."""
        return (self.kvmetrics_cpu_ns + self._kv_cpu_ns + self._kv_uncharged_ns()[0]) / 1e9

    # -- end of a recorded step --------------------------------------------------------

    def _kv_end_step(self, step: int, eventless: bool) -> None:
        """Record the step (``eventless``: only because the gauges may be due); timed
        every time, since it is rare and its cost varies (owncost)."""
        now = monotonic_ns()
        periodic = now >= self._kv_read_next_ns
        if eventless and not periodic:
            return  # not due yet: nothing to record
        start = thread_time_ns()
        try:
            self._kv_end_step_timed(step, periodic, now, eventless)
        finally:
            self._kv_timed(thread_time_ns() - start)

    def _kv_end_step_timed(self, step: int, periodic: bool, now: int, eventless: bool) -> None:
        if eventless:
            self._kv_check_flag()
        try:
            events = self._kv.take_step(step)
        except Exception:
            self._kv_hook_failed(_OUTPUT_HOOK)
            events = StepEvents(step=step)
        try:
            self._kv_gauges(events)
        except Exception:
            self._kv_hook_failed(_OUTPUT_HOOK)
        if periodic:
            self._kv_read_next_ns = now + self._kv_read_gap_ns
            try:
                self._kv_charge()
            except Exception:
                self._kv_hook_failed(_OUTPUT_HOOK)
            # The estimate so far (this step's own part is counted with the next report).
            spent = self._kv_cpu_ns
            if spent > 0:
                self._kv_cpu_ns = 0
                self.kvmetrics_cpu_ns += spent
                events.count(cat.INSTRUMENTATION_CPU, spent / 1e9)
        self._kv_record(events)

    def _kv_check_flag(self) -> None:
        """A step the recorder's ``must_record`` flag called quiet must hold no event and
        no fault: otherwise a path of the recorder forgot to set it, and those events
        would have waited for this periodic step. Counted as a fault of the output hook,
        so the drift shows on the endpoint."""
        try:
            ev = self._kv.events
            if (ev.increments or ev.rollbacks or ev.discarded_tokens
                    or ev.recovery_seconds is not None or self._kv_errors):
                raise RuntimeError("kvmetrics: a step with events was not flagged for "
                                   "recording (StepRecorder.must_record)")
        except Exception:
            self._kv_hook_failed(_OUTPUT_HOOK)

    def _kv_record(self, events: StepEvents) -> None:
        """Hand a step's events on: counters of disabled hooks out, hook faults in."""
        if self._kv_disabled:
            off = self._kv_disabled
            events.increments = [i for i in events.increments if i.spec.name not in off]
            if cat.RECOVERY_DURATION.name in off:
                events.recovery_seconds = None
        if self._kv_errors:
            errors, self._kv_errors = self._kv_errors, {}
            for hook, n in errors.items():
                events.count(cat.INSTRUMENTATION_ERRORS, n, hook)
        pipeline = self.kvmetrics_pipeline
        if pipeline is None:
            self._kv_ready.append(events)
            return
        try:
            pipeline.record(events)
        except CounterViolationError:
            raise
        except Exception:
            log.exception("kvmetrics failed to record step %d; the engine continues",
                          events.step)

    def _kv_gauges(self, events: StepEvents) -> None:
        if self._kv_holding_attr is None:
            return  # an attribute is missing: reported once at start, gauges absent
        me: Any = self
        events.gauges = self._kv_self_checks.gauges(me, self._kv_holding_attr, self._kv_step,
                                                    events)
        pool = me.kv_cache_manager.block_pool
        step = self._kv_step
        if step < self._kv_audit_next and events.recovery_seconds is None:
            return
        self._kv_audit_next = step + self._kv_audit_every
        used = negative = 0
        for block in pool.blocks:
            if block.is_null:
                continue
            if block.ref_cnt > 0:
                used += 1
            elif block.ref_cnt < 0:
                negative += 1
        events.pool = PoolSnapshot(free_blocks=pool.get_num_free_blocks(), used_blocks=used,
                                   total_blocks=pool.num_gpu_blocks - 1,
                                   negative_ref_counts=negative)

    def drain_events(self) -> list[StepEvents]:
        """Steps completed since the last call, when no pipeline records them here."""
        ready, self._kv_ready = self._kv_ready, []
        return ready

