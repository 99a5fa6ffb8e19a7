"""vLLM schedulers that export kvmetrics' counters, for ``vllm serve --scheduler-cls``.

``InstrumentedScheduler`` subclasses vLLM's ``Scheduler``, and is built over vLLM's
``AsyncScheduler`` (``InstrumentedAsyncScheduler``) when vLLM decided async scheduling,
so adding kvmetrics never changes how vLLM schedules. Each override calls vLLM's own
method with the same arguments, returns its result unchanged and only *reads* state
around the call, so scheduling decisions are exactly vLLM's (a test compares them step by step).
Events are taken at vLLM's own decision points:

- lookups and prompt sources: ``kv_cache_manager.record_prefix_cache_stats``
  (called once per admission, after the allocation succeeded) and the
  connector's ``update_state_after_alloc`` (the external tokens granted);
  vLLM's ``connector_prefix_cache_stats`` object is not used because it exists
  only with ``log_stats`` and is replaced every stats interval;
- recomputed tokens: the pre-step computed counts vLLM writes into the
  scheduler output, against a per-request high-water mark;
- loads: the block range granted at admission and ``invalid_block_ids``;
- recovery: ``_update_requests_with_invalid_blocks`` / ``_handle_failed_recving``
  (per-request before/after read around one call), timed in ``_handle_invalid_blocks``;
- evictions: the block pool's ``_maybe_evict_cached_block`` (capacity, or
  kv_load_failure inside ``evict_blocks``) and ``reset_prefix_cache``;
- preemptions: ``_preempt_request``; finishes: ``_free_request``.

Nothing a hook evaluates can raise into vLLM, by construction (:mod:`.observe`): vLLM's
method is called once with the arguments it passed, and everything kvmetrics reads runs
in a guard (only strict mode raises :class:`CounterViolationError`, on purpose). Every
hooked vLLM method is listed in :mod:`kvmetrics.vllm.hooks` and checked at
construction; overrides take ``*args, **kwargs`` and hand them to vLLM untouched, so a
new optional parameter passes through. A missing or changed method (or vLLM attribute a
hook reads), and a hook that raises at run time, turns off only its hook: the families
that need it leave the page (never shown as 0 nor frozen), it is logged once and counted
once in ``kvmetrics_instrumentation_errors_total{hook}`` (:mod:`.state`).
"""

from __future__ import annotations

import logging
from time import perf_counter_ns
from types import FunctionType
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvmetrics.metrics.events import StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline
from kvmetrics.protect.recovery import (
    ProtectMixin,
    protect_decided,
    protected_over,
    recovery_setting,
)
from kvmetrics.vllm import fingerprints, hooks, native_stats, owncost, step_end
from kvmetrics.vllm.base_choice import log_scheduler_base
from kvmetrics.vllm.event_hooks import EventHooks
from kvmetrics.vllm.exporting import (
    LOGGER,
    Exporter,
    build_exporter,
    check_setting_keys,
    settings_for,
)
from kvmetrics.vllm.helper_hooks import install_helper_wrappers
from kvmetrics.vllm.hooks import argument
from kvmetrics.vllm.observe import guarded, report_fault
from kvmetrics.vllm.state import OUTPUT_HOOK, SCHEDULE_HOOK, InstrumentState
from kvmetrics.vllm.step_end import (  # noqa: F401 - the documented names
    GAUGE_EVERY,
    GAUGE_MIN_INTERVAL_S,
    POOL_AUDIT_BLOCKS,
    POOL_AUDIT_EVERY,
    StepEnd,
)

log = logging.getLogger(LOGGER)


def _after_schedule(kv: InstrumentState, sched: Any, out: Any) -> None:
    """Close a schedule() call: which new loads vLLM made async, what it scheduled again."""
    requests = sched.requests
    waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
    async_admitted = set()
    for rid, _ in kv.new_loads:
        request = requests.get(rid)
        if request is not None and request.status == waiting:
            async_admitted.add(rid)
    kv.scheduled(id(out), out.num_scheduled_tokens,
                 lambda rid: requests[rid].num_computed_tokens, async_admitted)


def _loads_done(kv: InstrumentState, sched: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> None:
    """Count the outcomes of the loads this output reports (before vLLM processes it)."""
    scheduler_output = argument(args, kwargs, 0, "scheduler_output")
    kv_out = argument(args, kwargs, 1, "model_runner_output").kv_connector_output
    if kv_out is None:
        kv.loads_done(id(scheduler_output), set(), set())
        return
    kv.loads_done(id(scheduler_output), set(kv_out.invalid_block_ids),
                  set(kv_out.finished_recving or ()),
                  set(getattr(kv_out, "failed_recving", None) or ()))


if TYPE_CHECKING:  # the mixin's super() is vLLM's scheduler: checked as such
    _SchedulerBase = Scheduler
else:
    _SchedulerBase = object


class InstrumentedMixin(StepEnd, EventHooks, _SchedulerBase):
    """The hooks; mixed into vLLM's Scheduler or AsyncScheduler.

    The two overrides vLLM calls on every step (``schedule``, ``update_from_output``)
    are one call deep on a step where nothing happened: vLLM's method (the next class's
    function, resolved at construction and called with the arguments as given), then a
    few attribute tests and integer updates inline, no further call and no clock (but on
    one step in 64, when that inline code is timed in place for the CPU estimate:
    owncost). Everything that can be decided once (hooks usable, protective mode on or
    off, the calibration of the CPU estimate) is decided at construction.
    """

    kvmetrics_exporter: Exporter | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # The protective mode is in the class only when it is on: no pass-through layer.
        if protect_decided(args, kwargs) and not issubclass(cls, ProtectMixin):
            cls = protected_over(cls)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        me: Any = self
        check_setting_keys(me.vllm_config)  # a misspelt setting stops startup, on purpose
        # Set by ProtectMixin when the fix is in the class; read here otherwise.
        if not isinstance(self, ProtectMixin):
            self.kvmetrics_recovery = recovery_setting(me.vllm_config)
            if self.kvmetrics_recovery == "evict":
                raise RuntimeError("kvmetrics: KVMETRICS_RECOVERY=evict, but this scheduler "
                                   "class was built without the protective recovery")
            #: How this vLLM compares with the versions kvmetrics was verified on.
            self.kvmetrics_vllm = fingerprints.check_safely()
        self.kvmetrics_exporter = None
        #: Hook name -> why it is out (missing, changed signature); set at construction.
        self.kvmetrics_broken_hooks: dict[str, str] = {}
        # Read through getattr: a vLLM without it is reported by the check below.
        policy = "recompute" if getattr(me, "recompute_kv_load_failures", True) else "fail"
        #: All of kvmetrics' state for this scheduler (state.py).
        self._kv = kv = InstrumentState(me.block_size, policy, me.connector is not None)
        self._kv_check_hooks(kv)
        # The next class's two methods, called directly on the usual call (no super
        # object, no re-packed arguments: vLLM's code runs as it would without us).
        kv.next_schedule = _next_function(self, "schedule")
        kv.next_update = _next_function(self, "update_from_output")
        kv.read_gap_ns = round(step_end.GAUGE_MIN_INTERVAL_S * 1e9)
        kv.gauge_every = step_end.GAUGE_EVERY
        self._kv_setup_cost(kv)
        blocks = me.kv_cache_manager.block_pool.num_gpu_blocks
        kv.audit_every = kv.audit_next = max(step_end.POOL_AUDIT_EVERY,
                                             blocks // step_end.POOL_AUDIT_BLOCKS)
        verification = self.kvmetrics_vllm
        if verification is not None and not verification.verified:
            log.warning("kvmetrics: %s; kvmetrics was not verified on this vLLM code, so the "
                        "figures that depend on it may be wrong (docs/vllm.md, verified "
                        "versions)", verification.summary())
        try:
            kv.native_load = native_stats.available(self)
        except Exception:
            log.exception("kvmetrics could not tell whether vLLM reports KV-load failure "
                          "figures; they are not compared")
        try:
            install_helper_wrappers(self, kv)
        except Exception as e:  # which were installed is unknown: all off, absent, counted
            for hook in hooks.HOOKS:
                if hook.owner != "scheduler":
                    kv.fault(hook.name, f"helper hooks could not be installed ({e!r})")
        try:
            settings = settings_for(me.vllm_config)
            settings.recovery = self.kvmetrics_recovery
            if verification is not None:
                settings.vllm = (verification.version, str(verification.verified).lower(),
                                 verification.differ_label())
            if settings.export:
                settings.absent_families = kv.disabled
                kv.newly_absent = set()  # the pipeline starts without them
                self.kvmetrics_exporter = build_exporter(settings)
                kv.pipeline = self.kvmetrics_exporter.pipeline
        except Exception:
            log.exception("kvmetrics export disabled: settings or exporter failed")
        if self.kvmetrics_broken_hooks:
            # Visible on the endpoint from the start, before any request.
            self._kv_record(StepEvents(step=0))
        log_scheduler_base(self)  # answers vLLM's "degraded performance" warning

    @property
    def kvmetrics_pipeline(self) -> MetricsPipeline | None:
        """The pipeline this scheduler records its steps into (None: ``drain_events``)."""
        return self._kv.pipeline

    @kvmetrics_pipeline.setter
    def kvmetrics_pipeline(self, pipeline: MetricsPipeline | None) -> None:
        self._kv.pipeline = pipeline

    @property
    def kvmetrics_protecting(self) -> bool:
        """Whether the protective recovery runs (then :class:`ProtectMixin` is in the class)."""
        return isinstance(self, ProtectMixin)

    # -- construction-time decisions ---------------------------------------------------

    def _kv_check_hooks(self, kv: InstrumentState) -> None:
        """Turn off the hooks this vLLM cannot serve (the same path as a hook that
        faults at run time: counted, logged once, its families off the page)."""
        try:
            broken = hooks.check_hooks(self, hooks.vllm_base(type(self)))
        except Exception:
            log.exception("kvmetrics could not check vLLM's hooks; assuming they match")
            broken = {}
        self.kvmetrics_broken_hooks = broken
        if not kv.disabled & set(hooks.GAUGE_FAMILIES):
            kv.holding_attr = hooks.resolve_attribute(self, hooks.HOLDING_WAITING)
        for name, problem in broken.items():
            kv.fault(name, problem)

    def _kv_setup_cost(self, kv: InstrumentState) -> None:
        """The calibration of kvmetrics' own CPU estimate (owncost), once per process."""
        try:
            kv.cal = owncost.calibrate()
        except Exception:
            log.exception("kvmetrics could not calibrate its CPU estimate; it will leave "
                          "out the work it does not time")
        kv.clock_ns = round(kv.cal.clock_ns)

    # -- the two overrides of every step -----------------------------------------------
    # Written by hand for their cost: one lookup of the state, slots read inline.
    # Everything kvmetrics evaluates is inside a try (free in CPython until it raises)
    # whose fault is counted (report_fault); vLLM's method is called once, outside.

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        try:
            kv = self._kv
            # On a sampled step (owncost, part 2) the inline code is timed in place: one
            # interval on each side of vLLM's method.
            sampled = kv.step % kv.sample_every == kv.sample_phase
            t0 = perf_counter_ns() if sampled else 0
            vllm_schedule = kv.next_schedule if not args and not kwargs else None
            own = perf_counter_ns() - t0 if sampled else 0
        except Exception:
            report_fault(self, SCHEDULE_HOOK)
            return super().schedule(*args, **kwargs)
        # The usual call without re-packing arguments; any other through super().
        out = (vllm_schedule(self) if vllm_schedule is not None
               else super().schedule(*args, **kwargs))
        try:
            t0 = perf_counter_ns() if sampled else 0
            pending = kv.schedule_work  # else scheduled() finds nothing
            if sampled:
                kv.samples.add(0, own + perf_counter_ns() - t0)
        except Exception:
            report_fault(self, SCHEDULE_HOOK)
            return out
        if pending:
            guarded(self, SCHEDULE_HOOK, _after_schedule, out)
        return out

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        try:
            kv = self._kv
            sampled = kv.step % kv.sample_every == kv.sample_phase  # as in schedule()
            t0 = perf_counter_ns() if sampled else 0
            off = kv.output_off
            pending = kv.output_work  # else loads_done() finds nothing
            vllm_update = kv.next_update if len(args) == 2 and not kwargs else None
            own = perf_counter_ns() - t0 if sampled else 0
        except Exception:
            report_fault(self, OUTPUT_HOOK)
            result = super().update_from_output(*args, **kwargs)
            self._kv_publish_fault()
            return result
        if off:
            return super().update_from_output(*args, **kwargs)
        if pending:  # before vLLM processes the output; timed on its own
            guarded(self, OUTPUT_HOOK, _loads_done, args, kwargs)
        if vllm_update is not None:
            result = vllm_update(self, args[0], args[1])
        else:
            result = super().update_from_output(*args, **kwargs)
        if kv.native_load:
            try:
                native_stats.add_step(kv, result)
            except Exception:
                native_stats.give_up(kv)
        try:
            t0 = perf_counter_ns() if sampled else 0
            step = kv.step = kv.step + 1
            # Nothing to record: no event, no hook fault, and a pipeline to skip it for.
            eventless = not kv.must_record and kv.pipeline is not None
            due = not eventless or not step % kv.gauge_every  # or the periodic read
            if sampled:
                kv.samples.add(1, own + perf_counter_ns() - t0)
        except Exception:
            report_fault(self, OUTPUT_HOOK)
            self._kv_publish_fault()
            return result
        if due:
            self._kv_end_step(step, eventless)
        return result

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self.kvmetrics_exporter is not None:
                self.kvmetrics_exporter.shutdown()


def _next_function(sched: InstrumentedMixin, name: str) -> Any:
    """The plain function ``super(InstrumentedMixin, sched).<name>`` resolves to now (the
    protective mode's or vLLM's), or None when it is not a plain function (then the
    override goes through ``super()`` on every call, as before). Resolved once, at
    construction: a patch to that class's method made after the scheduler was built is
    not seen."""
    try:
        bound = getattr(super(InstrumentedMixin, sched), name)
        fn = getattr(bound, "__func__", None)
        if isinstance(fn, FunctionType) and getattr(bound, "__self__", None) is sched:
            return fn
    except Exception:
        log.exception("kvmetrics: could not resolve vLLM's %s; calling it through super()",
                      name)
    return None


def async_decided(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether vLLM decided async scheduling for the engine this scheduler is built for
    (``VllmConfig.scheduler_config.async_scheduling``, passed as ``vllm_config``)."""
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    sched_config = getattr(vllm_config, "scheduler_config", None)
    return bool(getattr(sched_config, "async_scheduling", False))


class InstrumentedScheduler(InstrumentedMixin, Scheduler):
    """vLLM's scheduler plus kvmetrics counters (and, opt-in, the protective recovery
    of :mod:`kvmetrics.protect.recovery`, added to the class only when it is
    on), the one class to name in ``--scheduler-cls``.

    It follows vLLM's own decision on async scheduling: vLLM resolves
    ``--scheduler-cls`` to this class whatever it decided, and a plain ``Scheduler``
    under async scheduling cannot keep a step in flight while the next is scheduled
    (vLLM's "degraded performance" case). So construction looks at
    ``vllm_config.scheduler_config.async_scheduling`` and, when it is on, builds the
    same class over vLLM's ``AsyncScheduler`` instead (:class:`InstrumentedAsyncScheduler`,
    or for an operator's own subclass a twin made once). Python calls ``__init__``
    on it as usual because the twin is a subclass of the class named.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if async_decided(args, kwargs) and not issubclass(cls, AsyncScheduler):
            cls = async_twin(cls)
        return super().__new__(cls, *args, **kwargs)


class InstrumentedAsyncScheduler(InstrumentedScheduler, AsyncScheduler):
    """The instrumented scheduler over vLLM's ``AsyncScheduler``: what
    :class:`InstrumentedScheduler` builds when vLLM decided async scheduling. Naming it
    in ``--scheduler-cls`` still works and forces the async base."""


_TWINS: dict[type, type] = {InstrumentedScheduler: InstrumentedAsyncScheduler}


def async_twin(cls: type) -> type:
    """``cls`` over vLLM's ``AsyncScheduler`` (a subclass of ``cls``), made once per class."""
    twin = _TWINS.get(cls)
    if twin is None:
        twin = type(f"{cls.__name__}Async", (cls, AsyncScheduler),
                    {"__module__": cls.__module__, "__doc__": cls.__doc__})
        _TWINS[cls] = twin
    return twin
