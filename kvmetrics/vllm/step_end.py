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
from time import monotonic_ns, thread_time_ns
from typing import Any

from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import PoolSnapshot, StepEvents
from kvmetrics.metrics.guard import CounterViolationError
from kvmetrics.vllm import native_stats
from kvmetrics.vllm.exporting import LOGGER
from kvmetrics.vllm.observe import report_fault
from kvmetrics.vllm.state import GAUGES_HOOK, OUTPUT_HOOK, InstrumentState

log = logging.getLogger(LOGGER)

FREE_HOOK = "scheduler._free_request"

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

#: The CPU estimate is reported once this long has passed since its last report, with
#: the first recorded step that counts something else: there its increment costs a few
#: microseconds, the counting path being run anyway. Reported alone (on a periodic
#: gauge read) it would cost about as much as the rest of that read, so it is, only
#: once CPU_REPORT_ALONE_S has passed with no such step (a server at steady decode, no
#: request finishing). Both lags are far below a scrape interval, and nothing is lost
#: in between: the estimate accumulates until reported.
CPU_REPORT_MIN_INTERVAL_S = 1.0
CPU_REPORT_ALONE_S = 5.0

class StepEnd:
    """Recording a step, and kvmetrics' own CPU estimate; part of ``InstrumentedMixin``.
    Its state is the scheduler's one :class:`~.state.InstrumentState` (``_kv``)."""

    _kv: InstrumentState

    # -- kvmetrics' own CPU time (owncost) ---------------------------------------------

    def _kv_uncharged_ns(self) -> tuple[float, int, int]:
        """The estimated cost of what is never timed (the quiet part of every step,
        sampled in place; the eviction wrapper, calibrated) since the last charge, and
        the step and wrapper-call counts to it."""
        kv = self._kv
        step, calls = kv.step, kv.evict_calls
        return (kv.samples.step_ns() * (step - kv.charged_step)
                + kv.cal.evict_ns * (calls - kv.charged_evict_calls), step, calls)

    def _kv_charge(self) -> None:
        """Add the calibrated cost of what is never timed, up to now."""
        kv = self._kv
        ns, kv.charged_step, kv.charged_evict_calls = self._kv_uncharged_ns()
        kv.cpu_ns += ns

    @property
    def kvmetrics_cpu_ns(self) -> float:
        """kvmetrics' own CPU time reported so far (ns, an estimate)."""
        return self._kv.counted_cpu_ns

    @property
    def kvmetrics_cpu_seconds(self) -> float:
        """kvmetrics' own thread CPU time in this scheduler since it was built (estimate)."""
        kv = self._kv
        return (kv.counted_cpu_ns + kv.cpu_ns + self._kv_uncharged_ns()[0]) / 1e9

    # -- end of a recorded step --------------------------------------------------------

    def _kv_end_step(self, step: int, eventless: bool) -> None:
        """Record the step (``eventless``: only because the gauges may be due); timed
        every time, since it is rare and its cost varies (owncost). Never raises into
        vLLM: a fault is counted under the output hook (or the gauges')."""
        try:
            kv = self._kv
            now = monotonic_ns()
            periodic = now >= kv.read_next_ns
            if eventless and not periodic:
                return  # not due yet: nothing to record
            start = thread_time_ns()
        except Exception:
            report_fault(self, OUTPUT_HOOK)
            return
        try:
            self._kv_end_step_timed(kv, step, periodic, now, eventless)
        except CounterViolationError:
            raise
        except Exception:
            report_fault(self, OUTPUT_HOOK)  # every family leaves the page with it
            self._kv_publish_fault()
        finally:
            kv.timed(thread_time_ns() - start)

    def _kv_end_step_timed(self, kv: InstrumentState, step: int, periodic: bool, now: int,
                           eventless: bool) -> None:
        if not eventless:
            self._kv_fill(kv, kv.take_step(step), periodic, now)
        elif self._kv_flag_missed(kv):
            # Nothing was lost (the events are recorded now), so the hook stays on.
            kv.fault(OUTPUT_HOOK, turn_off=False)
            self._kv_fill(kv, kv.take_step(step), periodic, now)
        elif kv.evicted_n or kv.evicted_any:
            self._kv_fill(kv, kv.take_step(step), periodic, now)
        else:
            # Nothing accumulated: the reading travels in the empty accumulator, which
            # is emptied again once it is recorded (no new one is made for it).
            events = kv.events
            events.step = step
            try:
                self._kv_fill(kv, events, periodic, now)
            finally:
                events.increments = []
                events.gauges = events.pool = None
                kv.must_record = False

    def _kv_fill(self, kv: InstrumentState, events: StepEvents, periodic: bool,
                 now: int) -> None:
        """Add the gauges (and the CPU estimate when due) to a step's events; record it."""
        if kv.native_sum is not None or kv.native_unread:
            native_stats.compare(kv, events)
        try:
            self._kv_gauges(kv, events, periodic)
        except Exception:
            kv.fault(GAUGES_HOOK)
            events.gauges = events.pool = None
        if periodic:
            kv.read_next_ns = now + kv.read_gap_ns
        due = kv.cpu_report_next_ns
        if now >= due and (events.increments or (periodic and now >= due + kv.cpu_alone_ns)):
            kv.cpu_report_next_ns = now + round(CPU_REPORT_MIN_INTERVAL_S * 1e9)
            kv.cpu_alone_ns = round(max(0.0, CPU_REPORT_ALONE_S - CPU_REPORT_MIN_INTERVAL_S)
                                    * 1e9)
            self._kv_charge()
            # The estimate so far (this step's own part is counted with the next report).
            spent = kv.cpu_ns
            if spent > 0:
                kv.cpu_ns = 0
                kv.counted_cpu_ns += spent
                events.count(cat.INSTRUMENTATION_CPU, spent / 1e9)
        self._kv_record(events)

    @staticmethod
    def _kv_flag_missed(kv: InstrumentState) -> bool:
        """Whether a step the recorder's ``must_record`` flag called quiet holds an event
        or a fault: a path of the recorder forgot to set it, and those events waited
        for this periodic step. Counted as a fault of the output hook, so the drift
        shows on the endpoint."""
        ev = kv.events
        return bool(ev.increments or ev.rollbacks or ev.discarded_tokens
                    or ev.recovery_seconds is not None or kv.errors)

    def _kv_publish_fault(self) -> None:
        """Record a step that holds only the faults counted so far: the output hook that
        records steps may be off from now on, and the fault must still reach the page."""
        try:
            self._kv_record(StepEvents(step=self._kv.step))
        except CounterViolationError:
            raise
        except Exception:
            log.exception("kvmetrics could not record its own fault; the engine continues")

    def _kv_record(self, events: StepEvents) -> None:
        """Hand a step's events on: families of hooks that are off leave the page (at
        once, on a fault at run time) and their counts are dropped; hook faults in."""
        kv = self._kv
        pipeline = kv.pipeline
        if kv.newly_absent:
            absent, kv.newly_absent = kv.newly_absent, set()
            if pipeline is not None:
                pipeline.mark_absent(absent)
        if kv.disabled:
            off = kv.disabled
            events.increments = [i for i in events.increments if i.spec.name not in off]
            if cat.RECOVERY_DURATION.name in off:
                events.recovery_seconds = None
        if kv.errors:
            errors, kv.errors = kv.errors, {}
            for hook, n in errors.items():
                events.count(cat.INSTRUMENTATION_ERRORS, n, hook)
        if pipeline is None:
            kv.ready.append(events)
            return
        try:
            pipeline.record(events)
        except CounterViolationError:
            raise
        except Exception:
            log.exception("kvmetrics failed to record step %d; the engine continues",
                          events.step)

    def _kv_gauges(self, kv: InstrumentState, events: StepEvents, periodic: bool) -> None:
        if kv.holding_attr is None:
            return  # the gauges are off: reported once, gauges absent
        me: Any = self
        step = kv.step
        events.gauges = kv.self_checks.gauges(me, kv.holding_attr, events)
        if periodic and FREE_HOOK not in kv.off:
            tracked: Any = kv.requests
            live = me.requests
            if type(live) is dict:
                # Usually every tracked request is still live: that is tested in C
                # without building a set; the ones vLLM no longer holds only if not.
                tracked = () if tracked.keys() <= live.keys() else tracked.keys() - live.keys()
            if tracked:
                for rid in kv.self_checks.unseen_finishes(events, tracked, live):
                    kv.forget(rid)
        pool = me.kv_cache_manager.block_pool
        if step < kv.audit_next and events.recovery_seconds is None:
            return
        kv.audit_next = step + kv.audit_every
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
        kv = self._kv
        ready, kv.ready = kv.ready, []
        return ready
