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

Nothing a hook does may raise into vLLM: a fault is logged and the step goes on
(only strict mode raises :class:`CounterViolationError`, on purpose). Every hooked
vLLM method is listed in :mod:`kvmetrics.integrations.vllm.hooks` and checked at
construction; overrides take ``*args, **kwargs`` and hand them to vLLM untouched,
so a new optional parameter passes through. A missing or changed method (or vLLM
attribute a hook reads) turns off only its hook; the families that need it are left
off the page (never shown as 0), it is logged once and counted once (like a hook that
raises, each time) in ``kvmetrics_instrumentation_errors_total{hook}``.
"""

from __future__ import annotations

import logging
from time import perf_counter_ns
from types import FunctionType
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvmetrics.integrations.vllm import fingerprints, hooks, owncost, step_end
from kvmetrics.integrations.vllm.base_choice import log_scheduler_base
from kvmetrics.integrations.vllm.event_hooks import EventHooks, _guarded
from kvmetrics.integrations.vllm.exporting import (
    LOGGER,
    Exporter,
    build_exporter,
    check_setting_keys,
    settings_for,
)
from kvmetrics.integrations.vllm.helper_hooks import install_helper_wrappers
from kvmetrics.integrations.vllm.hooks import argument
from kvmetrics.integrations.vllm.protect import (
    ProtectMixin,
    protect_decided,
    protected_over,
    recovery_setting,
)
from kvmetrics.integrations.vllm.recorder import StepRecorder
from kvmetrics.integrations.vllm.selfcheck import SelfChecks
from kvmetrics.integrations.vllm.step_end import (  # noqa: F401 - the documented names
    GAUGE_EVERY,
    GAUGE_MIN_INTERVAL_S,
    POOL_AUDIT_BLOCKS,
    POOL_AUDIT_EVERY,
    StepEnd,
)
from kvmetrics.metrics.events import StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline

log = logging.getLogger(LOGGER)

_OUTPUT_HOOK = "scheduler.update_from_output"
# The overrides test the step count against literals (a constant is read from the code
# object, a module global from the module's dict: one cold cache line fewer per step).
if (owncost.SAMPLE_EVERY, owncost.SAMPLE_PHASE, GAUGE_EVERY) != (64, 20, 32):
    raise ImportError("kvmetrics: the literals in InstrumentedMixin's overrides "
                      "(63, 20, 32) no longer match owncost and step_end")


class InstrumentedMixin(StepEnd, EventHooks):
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
    kvmetrics_pipeline: MetricsPipeline | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # The protective mode is in the class only when it is on: no pass-through layer.
        if protect_decided(args, kwargs) and not issubclass(cls, ProtectMixin):
            cls = protected_over(cls)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        # The attributes the two overrides read on every step, set first and together:
        # vLLM's scheduler has too many attributes for a shared-key dict, and entries
        # inserted together share the dict's cache lines (their values are set below).
        self._kv_next_schedule: Any = None
        self._kv: StepRecorder = None  # type: ignore[assignment]
        self._kv_step = 0
        self._kv_output_off = False
        self._kv_next_update: Any = None
        self.kvmetrics_pipeline = None
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
        #: kvmetrics' own CPU time not yet counted (ns, an estimate: owncost), and the
        #: total counted since start (``kvmetrics_instrumentation_cpu_seconds_total``).
        self._kv_cpu_ns: float = 0
        self.kvmetrics_cpu_ns: float = 0
        self._kv_ready: list[StepEvents] = []
        self.kvmetrics_exporter = None
        #: Hook name -> why it is out (missing, changed signature); set at construction.
        self.kvmetrics_broken_hooks: dict[str, str] = {}
        self._kv_disabled: frozenset[str] = frozenset()
        self._kv_off: frozenset[str] = frozenset()
        #: vLLM's name for the queue of requests held back while their KV arrives;
        #: None when an attribute the gauges read is missing (gauges then absent).
        self._kv_holding_attr: str | None = "kv_holding_waiting"
        #: Hook faults since the last recorded step, and the hooks already logged.
        self._kv_errors: dict[str, int] = {}
        self._kv_logged: set[str] = set()
        #: The request gauges from vLLM's own accessor, checked against kvmetrics' count.
        self._kv_self_checks = SelfChecks()
        self._kv_check_hooks()
        # Read through getattr: a vLLM without it is reported by the check above.
        policy = "recompute" if getattr(me, "recompute_kv_load_failures", True) else "fail"
        self._kv = StepRecorder(me.block_size, policy, me.connector is not None,
                                schedule_hooked="scheduler.schedule" not in self._kv_off)
        self._kv_output_off = _OUTPUT_HOOK in self._kv_off
        # The next class's two methods, called directly on the usual call (no super
        # object, no re-packed arguments: vLLM's code runs as it would without us).
        self._kv_next_schedule = _next_function(self, "schedule")
        self._kv_next_update = _next_function(self, "update_from_output")
        self._kv_read_gap_ns = round(step_end.GAUGE_MIN_INTERVAL_S * 1e9)
        self._kv_read_next_ns = 0  # the first GAUGE_EVERY-th step reads them
        self._kv_setup_cost()
        blocks = me.kv_cache_manager.block_pool.num_gpu_blocks
        every = max(step_end.POOL_AUDIT_EVERY, blocks // step_end.POOL_AUDIT_BLOCKS)
        self._kv_audit_every = every
        self._kv_audit_next = every
        verification = self.kvmetrics_vllm
        if verification is not None and not verification.verified:
            log.warning("kvmetrics: %s; kvmetrics was not verified on this vLLM code, so the "
                        "figures that depend on it may be wrong (docs/vllm.md, verified "
                        "versions)", verification.summary())
        try:
            install_helper_wrappers(self, self._kv_on, self._kv_call_guarded,
                                    self._kv_hook_failed, self._kv)
        except Exception:
            log.exception("kvmetrics could not hook vLLM's cache manager; counts will be partial")
        try:
            settings = settings_for(me.vllm_config)
            settings.recovery = self.kvmetrics_recovery
            if verification is not None:
                settings.vllm = (verification.version, str(verification.verified).lower(),
                                 ",".join(t.partition(":")[2] for t in verification.differing))
            if settings.export:
                settings.absent_families = self._kv_disabled
                self.kvmetrics_exporter = build_exporter(settings)
                self.kvmetrics_pipeline = self.kvmetrics_exporter.pipeline
        except Exception:
            log.exception("kvmetrics export disabled: settings or exporter failed")
        if self.kvmetrics_broken_hooks:
            # Visible on the endpoint from the start, before any request.
            self._kv_record(StepEvents(step=0))
        log_scheduler_base(self)  # answers vLLM's "degraded performance" warning

    @property
    def kvmetrics_protecting(self) -> bool:
        """Whether the protective recovery runs (then :class:`ProtectMixin` is in the class)."""
        return isinstance(self, ProtectMixin)

    # -- construction-time decisions ---------------------------------------------------

    def _kv_check_hooks(self) -> None:
        try:
            broken = hooks.check_hooks(self, hooks.vllm_base(type(self)))
        except Exception:
            log.exception("kvmetrics could not check vLLM's hooks; assuming they match")
            return
        self.kvmetrics_broken_hooks = broken
        self._kv_off = frozenset(broken)
        self._kv_disabled = hooks.disabled_families(broken)
        gauges_on = not self._kv_disabled & set(hooks.GAUGE_FAMILIES)
        self._kv_holding_attr = (hooks.resolve_attribute(self, hooks.HOLDING_WAITING)
                                 if gauges_on else None)
        for name, problem in broken.items():
            self._kv_errors[name] = self._kv_errors.get(name, 0) + 1
            self._kv_logged.add(name)
            log.warning("kvmetrics: vLLM hook %s unusable (%s); left off the metrics page: %s",
                        name, problem,
                        ", ".join(sorted(hooks.BY_NAME[name].families)) or "nothing")

    def _kv_setup_cost(self) -> None:
        """The calibration of kvmetrics' own CPU estimate (owncost), once per process."""
        self._kv_charged_step = 0
        self._kv_charged_evict_calls = 0
        self._kv_samples = owncost.QuietSamples()
        try:
            cal = owncost.calibrate()
        except Exception:
            log.exception("kvmetrics could not calibrate its CPU estimate; it will leave "
                          "out the work it does not time")
            cal = owncost.Calibration()
        self._kv_cal = cal
        self._kv_clock_ns = round(cal.clock_ns)

    def _kv_on(self, hook: str) -> bool:
        return hook not in self._kv_off

    # -- the two overrides of every step -----------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        # One step in 64 the inline part is timed in place (owncost, part 2), from the
        # first read of kvmetrics' state after the step count to the last, vLLM's
        # method and the hooks timed on their own left out.
        sampled = self._kv_step & 63 == 20  # owncost.SAMPLE_EVERY, SAMPLE_PHASE
        if sampled:
            t0 = perf_counter_ns()
        vllm_schedule = self._kv_next_schedule
        usual = vllm_schedule is not None and not args and not kwargs
        if sampled:
            own = perf_counter_ns() - t0
        # The usual call without re-packing arguments; any other through super().
        out = (vllm_schedule(self) if usual
               else super().schedule(*args, **kwargs))  # type: ignore[misc]
        if sampled:
            t0 = perf_counter_ns()
        try:
            pending = self._kv.schedule_work  # else scheduled() finds nothing
        except Exception:
            pending = True  # the guarded hook meets the fault and counts it
        if sampled:
            self._kv_sampled(0, own + perf_counter_ns() - t0, 2)
        if pending:
            self._kv_after_schedule(out)
        return out

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        sampled = self._kv_step & 63 == 20  # as in schedule()
        if sampled:
            t0 = perf_counter_ns()
        if self._kv_output_off:
            return super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        kv = self._kv
        try:
            pending = kv.output_work  # else loads_done() finds nothing
        except Exception:
            pending = True
        if sampled:
            own = perf_counter_ns() - t0
        if pending:
            self._kv_before_output(args, kwargs)  # timed on its own
        if sampled:
            t0 = perf_counter_ns()
        vllm_update = self._kv_next_update
        usual = vllm_update is not None and len(args) == 2 and not kwargs
        if sampled:
            own += perf_counter_ns() - t0
        if usual:
            result = vllm_update(self, args[0], args[1])
        else:
            result = super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        if sampled:
            t0 = perf_counter_ns()
        step = self._kv_step = self._kv_step + 1
        try:
            # Nothing to record: no event, no hook fault, and a pipeline to skip it for.
            eventless = not kv.must_record and self.kvmetrics_pipeline is not None
        except Exception:
            eventless = False  # the full path below meets the fault and counts it
        if sampled:
            self._kv_sampled(1, own + perf_counter_ns() - t0, 3)
        if not eventless or not step % 32:  # step_end.GAUGE_EVERY
            self._kv_end_step(step, eventless)
        return result

    @_guarded("scheduler.schedule")
    def _kv_after_schedule(self, out: Any) -> None:
        me: Any = self
        requests = me.requests
        waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
        async_admitted = set()
        for rid, _ in self._kv.new_loads:
            request = requests.get(rid)
            if request is not None and request.status == waiting:
                async_admitted.add(rid)
        self._kv.scheduled(id(out), out.num_scheduled_tokens,
                           lambda rid: requests[rid].num_computed_tokens, async_admitted)

    @_guarded(_OUTPUT_HOOK)
    def _kv_before_output(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        scheduler_output = argument(args, kwargs, 0, "scheduler_output")
        kv_out = argument(args, kwargs, 1, "model_runner_output").kv_connector_output
        if kv_out is None:
            self._kv.loads_done(id(scheduler_output), set(), set())
            return
        self._kv.loads_done(id(scheduler_output), set(kv_out.invalid_block_ids),
                            set(kv_out.finished_recving or ()),
                            set(getattr(kv_out, "failed_recving", None) or ()))

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[misc]
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
    of :mod:`kvmetrics.integrations.vllm.protect`, added to the class only when it is
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
