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

import functools
import logging
import math
import random
import time
from collections.abc import Callable
from time import thread_time_ns
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvmetrics.integrations.vllm import hooks
from kvmetrics.integrations.vllm.exporting import (
    LOGGER,
    Exporter,
    build_exporter,
    check_setting_keys,
    settings_for,
)
from kvmetrics.integrations.vllm.helper_hooks import install_helper_wrappers
from kvmetrics.integrations.vllm.hooks import argument
from kvmetrics.integrations.vllm.protect import ProtectMixin
from kvmetrics.integrations.vllm.recorder import StepRecorder
from kvmetrics.integrations.vllm.selfcheck import SelfChecks
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import PoolSnapshot, StepEvents
from kvmetrics.metrics.guard import CounterViolationError
from kvmetrics.metrics.pipeline import MetricsPipeline

log = logging.getLogger(LOGGER)

#: The pool audit walks every block (O(blocks)), so it runs on every step that ran the
#: recovery path and otherwise every ``max(POOL_AUDIT_EVERY, blocks // POOL_AUDIT_BLOCKS)``
#: steps: about POOL_AUDIT_BLOCKS blocks walked per step, whatever the cache size. A
#: pool inconsistency that persists (a leaked block, a negative reference count) is
#: seen within that many steps; one that appears and heals between two audits away
#: from the recovery path is not.
POOL_AUDIT_EVERY = 1024
POOL_AUDIT_BLOCKS = 8

#: With a pipeline (as under ``vllm serve``), a step where nothing happened (no
#: admission, load, preemption, finish or fault) records nothing; its evictions are
#: counted with the next step recorded. The gauges are read on every step that
#: recorded something and on every GAUGE_EVERY-th step (so the gauges and the eviction
#: counter lag vLLM by fewer than GAUGE_EVERY steps). Without a pipeline (the lab's
#: drained events) every step is handed on with its gauges, as before.
GAUGE_EVERY = 32

#: kvmetrics' CPU time is added to ``kvmetrics_instrumentation_cpu_seconds_total``
#: every CPU_REPORT_EVERY steps (one increment per step would itself cost a share); a
#: multiple of GAUGE_EVERY, so that reporting adds no recorded step of its own. A
#: gauge read (vLLM's accessors, the self-check on steps that are multiples of
#: selfcheck.SELF_CHECK_EVERY, the exporters) costs a few microseconds, hence 32.
CPU_REPORT_EVERY = 64

#: The end-of-step work is timed on a random one step in CPU_SAMPLE_EVERY (each step
#: independently, with probability 1/CPU_SAMPLE_EVERY) and counted CPU_SAMPLE_EVERY
#: times: an unbiased estimate of its total, without two clock reads on most steps. The
#: rare recovery, admission and finish hooks are timed every time and counted once.
CPU_SAMPLE_EVERY = 64


def _guarded(hook: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Run the metrics side of ``hook``; count and log its faults, never raise them."""

    def wrap(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def run(self: Any, *args: Any, **kwargs: Any) -> None:
            start = thread_time_ns()
            try:
                fn(self, *args, **kwargs)
            except CounterViolationError:
                raise
            except Exception:
                self._kv_hook_failed(hook)
            finally:
                self._kv_cpu_ns += thread_time_ns() - start

        return run

    return wrap


class InstrumentedMixin:
    """The hooks; mixed into vLLM's Scheduler or AsyncScheduler."""

    kvmetrics_exporter: Exporter | None
    kvmetrics_pipeline: MetricsPipeline | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        me: Any = self
        check_setting_keys(me.vllm_config)  # a misspelt setting stops startup, on purpose
        #: Thread CPU time of kvmetrics' own work not yet counted, and since start
        #: (``kvmetrics_instrumentation_cpu_seconds_total``; benchmarks read the total).
        self._kv_cpu_ns = 0
        self.kvmetrics_cpu_ns = 0
        self._kv_ready: list[StepEvents] = []
        self._kv_step = 0
        self.kvmetrics_exporter = None
        self.kvmetrics_pipeline = None
        #: Hook name -> why it is out (missing, changed signature); set at construction.
        self.kvmetrics_broken_hooks: dict[str, str] = {}
        self._kv_disabled: frozenset[str] = frozenset()
        #: vLLM's name for the queue of requests held back while their KV arrives;
        #: None when an attribute the gauges read is missing (gauges then absent).
        self._kv_holding_attr: str | None = "kv_holding_waiting"
        #: Hook faults since the last recorded step, and the hooks already logged.
        self._kv_errors: dict[str, int] = {}
        self._kv_logged: set[str] = set()
        #: The request gauges from vLLM's own accessor, checked against kvmetrics' count.
        self._kv_self_checks = SelfChecks()
        # Read through getattr: a vLLM without it is reported by the check below.
        policy = "recompute" if getattr(me, "recompute_kv_load_failures", True) else "fail"
        self._kv = StepRecorder(me.block_size, policy, me.connector is not None)
        self._kv_check_hooks()
        on = self._kv_on
        self._kv_sched_on = on("scheduler.schedule")
        self._kv_output_on = on("scheduler.update_from_output")
        self._kv_rng = random.Random()
        self._kv_sample_in = self._kv_gap()
        blocks = me.kv_cache_manager.block_pool.num_gpu_blocks
        every = max(POOL_AUDIT_EVERY, blocks // POOL_AUDIT_BLOCKS)
        # A multiple of GAUGE_EVERY: the audit runs with a gauge read.
        self._kv_audit_every = -(-every // GAUGE_EVERY) * GAUGE_EVERY
        verification = getattr(self, "kvmetrics_vllm", None)
        if verification is not None and not verification.verified:
            log.warning("kvmetrics: %s; kvmetrics was not verified on this vLLM code, so the "
                        "figures that depend on it may be wrong (docs/vllm.md, verified "
                        "versions)", verification.summary())
        try:
            install_helper_wrappers(self, self._kv_on, self._kv_call_guarded,
                                    self._kv_hook_failed, self._kv_tally)
        except Exception:
            log.exception("kvmetrics could not hook vLLM's cache manager; counts will be partial")
        try:
            settings = settings_for(me.vllm_config)
            settings.recovery = getattr(self, "kvmetrics_recovery", "vllm")
            verification = getattr(self, "kvmetrics_vllm", None)
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

    # -- hook checks ---------------------------------------------------------------------

    def _kv_check_hooks(self) -> None:
        try:
            broken = hooks.check_hooks(self, hooks.vllm_base(type(self)))
        except Exception:
            log.exception("kvmetrics could not check vLLM's hooks; assuming they match")
            return
        self.kvmetrics_broken_hooks = broken
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

    def _kv_gap(self) -> int:
        """Steps until the next timed one: geometric with mean CPU_SAMPLE_EVERY, i.e.
        each step timed independently with probability 1/CPU_SAMPLE_EVERY."""
        if CPU_SAMPLE_EVERY <= 1:
            return 1
        u = 1.0 - self._kv_rng.random()  # in (0, 1]
        return int(math.log(u) / math.log(1.0 - 1.0 / CPU_SAMPLE_EVERY)) + 1

    def _kv_on(self, hook: str) -> bool:
        return hook not in self.kvmetrics_broken_hooks

    def _kv_hook_failed(self, hook: str) -> None:
        """A hook raised: count it on the endpoint, log its first fault (with traceback)."""
        self._kv_errors[hook] = self._kv_errors.get(hook, 0) + 1
        if hook not in self._kv_logged:
            self._kv_logged.add(hook)
            log.exception("kvmetrics hook %s failed; metrics may be incomplete", hook)

    def _kv_call_guarded(self, hook: str, method: str, *args: Any) -> None:
        """Call a recorder method by name for ``hook``; same fault policy as :func:`_guarded`."""
        start = thread_time_ns()
        try:
            getattr(self._kv, method)(*args)
        except CounterViolationError:
            raise
        except Exception:
            self._kv_hook_failed(hook)
        finally:
            self._kv_cpu_ns += thread_time_ns() - start

    def _kv_tally(self, hook: str, method: str, *args: Any) -> None:
        """:meth:`_kv_call_guarded` without the clock, for a hook that is a counter
        increment on ordinary steps (two clock reads would cost more than the work)."""
        try:
            getattr(self._kv, method)(*args)
        except Exception:
            self._kv_hook_failed(hook)

    def _kv_pending(self, *fields: str) -> bool:
        """Whether the recorder holds work in any of these fields, so that a step with
        none skips the hook; True when it cannot be read (the guarded hook then meets
        the fault and counts it)."""
        try:
            kv = self._kv
            return any(getattr(kv, name) for name in fields)
        except Exception:
            return True

    # -- scheduling --------------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if not self._kv_sched_on:
            self._kv.new_loads.clear()  # nobody will resolve their mode
        else:
            if self._kv_pending("new_loads", "redo"):  # else scheduled() finds nothing
                self._kv_after_schedule(out)
        return out

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

    def _preempt_request(self, *args: Any, **kwargs: Any) -> Any:
        hook = "scheduler._preempt_request"
        if not self._kv_on(hook):
            return super()._preempt_request(*args, **kwargs)  # type: ignore[misc]
        request = argument(args, kwargs, 0, "request")
        computed = getattr(request, "num_computed_tokens", 0)
        result = super()._preempt_request(*args, **kwargs)  # type: ignore[misc]
        self._kv_call_guarded(hook, "preempted", request.request_id, computed)
        return result

    def _free_request(self, *args: Any, **kwargs: Any) -> Any:
        hook = "scheduler._free_request"
        if self._kv_on(hook):
            request = argument(args, kwargs, 0, "request")
            try:
                rid, status = request.request_id, request.status.name
            except Exception:
                self._kv_hook_failed(hook)
            else:
                self._kv_call_guarded(hook, "finished", rid, status)
        return super()._free_request(*args, **kwargs)  # type: ignore[misc]

    # -- recovery path -----------------------------------------------------------------

    def _handle_invalid_blocks(self, *args: Any, **kwargs: Any) -> Any:
        if not self._kv_on("scheduler._handle_invalid_blocks"):
            return super()._handle_invalid_blocks(*args, **kwargs)  # type: ignore[misc]
        t0 = time.perf_counter()
        try:
            return super()._handle_invalid_blocks(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._kv_recovery_time(time.perf_counter() - t0)

    @_guarded("scheduler._handle_invalid_blocks")
    def _kv_recovery_time(self, seconds: float) -> None:
        ev = self._kv.events
        ev.recovery_seconds = (ev.recovery_seconds or 0.0) + seconds

    def _update_requests_with_invalid_blocks(self, *args: Any, **kwargs: Any) -> Any:
        hook = "scheduler._update_requests_with_invalid_blocks"
        if not self._kv_on(hook):
            return super()._update_requests_with_invalid_blocks(  # type: ignore[misc]
                *args, **kwargs)
        # vLLM passes a generator for async loads: read it once, hand vLLM the list.
        if args:
            scanned = list(args[0])
            args = (scanned, *args[1:])
        else:
            scanned = list(kwargs.get("requests", ()))
            kwargs["requests"] = scanned
        num_scheduled: dict[str, int] = argument(args, kwargs, 2, "num_scheduled_tokens", {})
        evict = bool(argument(args, kwargs, 3, "evict_blocks", True))
        before = self._kv_before_rollback(scanned, num_scheduled)
        result = super()._update_requests_with_invalid_blocks(  # type: ignore[misc]
            *args, **kwargs)
        if before is not None:
            self._kv_rolled_back(scanned, result[0], before, num_scheduled,
                                 "sync" if evict else "async")
        return result

    def _kv_before_rollback(self, scanned: list[Any],
                            num_scheduled: dict[str, int]) -> dict[str, int] | None:
        try:
            return {r.request_id: r.num_computed_tokens - num_scheduled.get(r.request_id, 0)
                    for r in scanned}
        except Exception:
            self._kv_hook_failed("scheduler._update_requests_with_invalid_blocks")
            return None

    @_guarded("scheduler._update_requests_with_invalid_blocks")
    def _kv_rolled_back(self, scanned: list[Any], affected: set[str], before: dict[str, int],
                        num_scheduled: dict[str, int], mode: str) -> None:
        for request in scanned:
            rid = request.request_id
            if rid in affected:
                self._kv.rolled_back(mode, rid, before[rid], request.num_computed_tokens,
                                     num_scheduled.get(rid, 0))

    def _handle_failed_recving(self, *args: Any, **kwargs: Any) -> Any:
        hook = "scheduler._handle_failed_recving"
        if not self._kv_on(hook):
            return super()._handle_failed_recving(*args, **kwargs)  # type: ignore[misc]
        me: Any = self
        failed_req_ids = argument(args, kwargs, 0, "failed_req_ids", ())
        waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
        try:
            hit = {rid: me.requests[rid].num_computed_tokens for rid in failed_req_ids
                   if rid in me.requests and me.requests[rid].status == waiting}
        except Exception:
            self._kv_hook_failed(hook)
            hit = {}
        result = super()._handle_failed_recving(*args, **kwargs)  # type: ignore[misc]
        # vLLM resets the computed count to 0 (recompute) or fails the request.
        for rid, before in hit.items():
            self._kv_call_guarded(hook, "rolled_back", "async", rid, before, 0, 0)
        return result

    # -- output ------------------------------------------------------------------------

    def kvmetrics_merge(self, events: StepEvents | None) -> None:
        """Fold a model runner's own events (verification) into the current step."""
        if events is not None:
            self._kv_call_guarded("scheduler.update_from_output", "merge_events", events)

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        if not self._kv_output_on:
            return super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        if self._kv_pending("sync_loads", "async_loads"):  # else loads_done() finds nothing
            self._kv_before_output(argument(args, kwargs, 0, "scheduler_output"),
                                   argument(args, kwargs, 1, "model_runner_output"))
        result = super().update_from_output(*args, **kwargs)  # type: ignore[misc]
        self._kv_end_step()
        return result

    @_guarded("scheduler.update_from_output")
    def _kv_before_output(self, scheduler_output: Any, model_runner_output: Any) -> None:
        kv_out = model_runner_output.kv_connector_output
        if kv_out is None:
            self._kv.loads_done(id(scheduler_output), set(), set())
            return
        self._kv.loads_done(id(scheduler_output), set(kv_out.invalid_block_ids),
                            set(kv_out.finished_recving or ()),
                            set(getattr(kv_out, "failed_recving", None) or ()))

    def _kv_end_step(self) -> None:
        self._kv_sample_in -= 1
        if self._kv_sample_in:
            self._kv_end_step_timed()
            return
        self._kv_sample_in = self._kv_gap()
        start = thread_time_ns()
        try:
            self._kv_end_step_timed()
        finally:
            self._kv_cpu_ns += (thread_time_ns() - start) * max(CPU_SAMPLE_EVERY, 1)

    def _kv_end_step_timed(self) -> None:
        hook = "scheduler.update_from_output"
        self._kv_step += 1
        step = self._kv_step
        if (self.kvmetrics_pipeline is not None and step % GAUGE_EVERY
                and step % CPU_REPORT_EVERY and not self._kv_errors):
            try:
                kv = self._kv
                if kv.quiet():
                    kv.events.step = step + 1  # nothing happened: nothing to record
                    return
            except Exception:
                pass  # the full path below meets the fault and counts it
        try:
            events = self._kv.take_step(self._kv_step)
        except Exception:
            self._kv_hook_failed(hook)
            events = StepEvents(step=self._kv_step)
        try:
            self._kv_gauges(events)
        except Exception:
            self._kv_hook_failed(hook)
        if self._kv_step % CPU_REPORT_EVERY == 0:
            # CPU time of the steps before this one (this step's part is counted with
            # the next report: no extra clock read, each costs about a microsecond).
            spent, self._kv_cpu_ns = self._kv_cpu_ns, 0
            self.kvmetrics_cpu_ns += spent
            events.count(cat.INSTRUMENTATION_CPU, spent / 1e9)
        self._kv_record(events)

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
        if self._kv_step % self._kv_audit_every and events.recovery_seconds is None:
            return
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

    @property
    def kvmetrics_cpu_seconds(self) -> float:
        """kvmetrics' own thread CPU time in this scheduler since it was built."""
        return (self.kvmetrics_cpu_ns + self._kv_cpu_ns) / 1e9

    def drain_events(self) -> list[StepEvents]:
        """Steps completed since the last call, when no pipeline records them here."""
        ready, self._kv_ready = self._kv_ready, []
        return ready

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            if self.kvmetrics_exporter is not None:
                self.kvmetrics_exporter.shutdown()


def async_decided(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether vLLM decided async scheduling for the engine this scheduler is built for
    (``VllmConfig.scheduler_config.async_scheduling``, passed as ``vllm_config``)."""
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    sched_config = getattr(vllm_config, "scheduler_config", None)
    return bool(getattr(sched_config, "async_scheduling", False))


class InstrumentedScheduler(InstrumentedMixin, ProtectMixin, Scheduler):
    """vLLM's scheduler plus kvmetrics counters (and, opt-in, the protective recovery
    of :mod:`kvmetrics.integrations.vllm.protect`), the one class to name in
    ``--scheduler-cls``.

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
        return super().__new__(cls)


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
