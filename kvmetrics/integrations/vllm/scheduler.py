"""vLLM schedulers that export kvmetrics' counters, for ``vllm serve --scheduler-cls``.

``InstrumentedScheduler`` subclasses vLLM's ``Scheduler`` (``InstrumentedAsyncScheduler``
its ``AsyncScheduler``). Each override calls vLLM's own method with the same
arguments, returns its result unchanged and only *reads* state around the call,
so scheduling decisions are exactly vLLM's (a test compares them step by step).
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
(only strict mode raises :class:`CounterViolationError`, on purpose).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvmetrics.integrations.vllm.exporting import Exporter, build_exporter, settings_for
from kvmetrics.integrations.vllm.recorder import StepRecorder
from kvmetrics.metrics.events import GaugeReadings, PoolSnapshot, StepEvents
from kvmetrics.metrics.guard import CounterViolationError
from kvmetrics.metrics.pipeline import MetricsPipeline

log = logging.getLogger("kvmetrics.vllm")

#: The pool audit walks every block (O(blocks)), so it runs every POOL_AUDIT_EVERY
#: steps and on every step that ran the recovery path, keeping the decode-step cost
#: of instrumentation negligible (see benchmarks/bench_vllm.py).
POOL_AUDIT_EVERY = 100


def _guarded(fn: Callable[..., None]) -> Callable[..., None]:
    """Run a metrics hook; log its faults instead of raising them into vLLM."""

    @functools.wraps(fn)
    def run(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(self, *args, **kwargs)
        except CounterViolationError:
            raise
        except Exception:
            if not getattr(self, "_kv_fault_logged", False):
                self._kv_fault_logged = True
                log.exception("kvmetrics hook %s failed; metrics may be incomplete",
                              fn.__name__)

    return run


class InstrumentedMixin:
    """The hooks; mixed into vLLM's Scheduler or AsyncScheduler."""

    kvmetrics_exporter: Exporter | None
    kvmetrics_pipeline: MetricsPipeline | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._kv_ready: list[StepEvents] = []
        self._kv_step = 0
        self._kv_fault_logged = False
        self.kvmetrics_exporter = None
        self.kvmetrics_pipeline = None
        me: Any = self
        policy = "recompute" if me.recompute_kv_load_failures else "fail"
        self._kv = StepRecorder(me.block_size, policy, me.connector is not None)
        try:
            self._kv_install_wrappers()
        except Exception:
            log.exception("kvmetrics could not hook vLLM's cache manager; counts will be partial")
        try:
            settings = settings_for(me.vllm_config)
            if settings.export:
                self.kvmetrics_exporter = build_exporter(settings)
                self.kvmetrics_pipeline = self.kvmetrics_exporter.pipeline
        except Exception:
            log.exception("kvmetrics export disabled: settings or exporter failed")

    # -- wrappers on vLLM's helper objects (instance attributes, this scheduler only) ----

    def _kv_install_wrappers(self) -> None:
        me: Any = self
        kvm = me.kv_cache_manager
        pool = kvm.block_pool
        call = self._kv_call_guarded

        record_stats = kvm.record_prefix_cache_stats

        def record_prefix_cache_stats(request: Any, num_hits: int) -> None:
            record_stats(request, num_hits)
            call("lookup", request.request_id, request.num_tokens, request.num_prompt_tokens,
                 request.num_preemptions, num_hits)

        kvm.record_prefix_cache_stats = record_prefix_cache_stats

        evict_blocks = kvm.evict_blocks

        def evict_blocks_hook(block_ids: set[int]) -> None:
            call("set_evict_cause", "kv_load_failure")
            try:
                evict_blocks(block_ids)
            finally:
                call("set_evict_cause", "capacity")

        kvm.evict_blocks = evict_blocks_hook

        maybe_evict = pool._maybe_evict_cached_block

        def maybe_evict_hook(block: Any) -> bool:
            evicted = maybe_evict(block)
            if evicted:
                call("evicted", 1)
            return evicted

        pool._maybe_evict_cached_block = maybe_evict_hook

        reset = kvm.reset_prefix_cache

        def reset_hook() -> bool:
            cached = sum(1 for b in pool.blocks if b.block_hash is not None and not b.is_null)
            ok = reset()
            if ok and cached:
                call("evicted", cached, "reset")
            return ok

        kvm.reset_prefix_cache = reset_hook

        if me.connector is not None:
            after_alloc = me.connector.update_state_after_alloc

            def update_state_after_alloc(request: Any, blocks: Any,
                                         num_external_tokens: int) -> Any:
                result = after_alloc(request, blocks, num_external_tokens)
                if num_external_tokens > 0:
                    try:
                        block_ids = list(blocks.get_block_ids()[0])
                    except Exception:
                        block_ids = []
                else:
                    block_ids = []
                call("allocated", request.request_id, block_ids, num_external_tokens)
                return result

            me.connector.update_state_after_alloc = update_state_after_alloc

    def _kv_call_guarded(self, method: str, *args: Any) -> None:
        """Call a recorder method by name; same fault policy as :func:`_guarded`."""
        try:
            getattr(self._kv, method)(*args)
        except CounterViolationError:
            raise
        except Exception:
            if not self._kv_fault_logged:
                self._kv_fault_logged = True
                log.exception("kvmetrics hook %s failed; metrics may be incomplete", method)

    # -- scheduling --------------------------------------------------------------------

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        self._kv_after_schedule(out)
        return out

    @_guarded
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

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        computed = request.num_computed_tokens
        super()._preempt_request(request, *args, **kwargs)  # type: ignore[misc]
        self._kv_call_guarded("preempted", request.request_id, computed)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self._kv_call_guarded("finished", request.request_id, request.status.name)
        return super()._free_request(request, *args, **kwargs)  # type: ignore[misc]

    # -- recovery path -----------------------------------------------------------------

    def _handle_invalid_blocks(self, invalid_block_ids: set[int],
                               num_scheduled_tokens: dict[str, int]) -> set[str]:
        t0 = time.perf_counter()
        try:
            return super()._handle_invalid_blocks(  # type: ignore[misc]
                invalid_block_ids, num_scheduled_tokens)
        finally:
            self._kv_recovery_time(time.perf_counter() - t0)

    @_guarded
    def _kv_recovery_time(self, seconds: float) -> None:
        ev = self._kv.events
        ev.recovery_seconds = (ev.recovery_seconds or 0.0) + seconds

    def _update_requests_with_invalid_blocks(
        self, requests: Iterable[Any], invalid_block_ids: set[int],
        num_scheduled_tokens: dict[str, int], evict_blocks: bool = True,
    ) -> tuple[set[str], int, set[int]]:
        scanned = list(requests)  # vLLM passes a generator for async loads
        before = {r.request_id: r.num_computed_tokens - num_scheduled_tokens.get(r.request_id, 0)
                  for r in scanned}
        result = super()._update_requests_with_invalid_blocks(  # type: ignore[misc]
            scanned, invalid_block_ids, num_scheduled_tokens, evict_blocks)
        self._kv_rolled_back(scanned, result[0], before, num_scheduled_tokens,
                             "sync" if evict_blocks else "async")
        return result

    @_guarded
    def _kv_rolled_back(self, scanned: list[Any], affected: set[str], before: dict[str, int],
                        num_scheduled: dict[str, int], mode: str) -> None:
        for request in scanned:
            rid = request.request_id
            if rid in affected:
                self._kv.rolled_back(mode, rid, before[rid], request.num_computed_tokens,
                                     num_scheduled.get(rid, 0))

    def _handle_failed_recving(self, failed_req_ids: set[str]) -> set[str]:
        me: Any = self
        waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
        hit = {rid: me.requests[rid].num_computed_tokens for rid in failed_req_ids
               if rid in me.requests and me.requests[rid].status == waiting}
        result = super()._handle_failed_recving(failed_req_ids)  # type: ignore[misc]
        # vLLM resets the computed count to 0 (recompute) or fails the request.
        for rid, before in hit.items():
            self._kv_call_guarded("rolled_back", "async", rid, before, 0, 0)
        return result

    # -- output ------------------------------------------------------------------------

    def kvmetrics_merge(self, events: StepEvents | None) -> None:
        """Fold a model runner's own events (verification) into the current step."""
        if events is not None:
            self._kv_call_guarded("merge_events", events)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        self._kv_before_output(scheduler_output, model_runner_output)
        result = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output)
        self._kv_end_step()
        return result

    @_guarded
    def _kv_before_output(self, scheduler_output: Any, model_runner_output: Any) -> None:
        kv_out = model_runner_output.kv_connector_output
        if kv_out is None:
            self._kv.loads_done(id(scheduler_output), set(), set())
            return
        self._kv.loads_done(id(scheduler_output), set(kv_out.invalid_block_ids),
                            set(kv_out.finished_recving or ()),
                            set(getattr(kv_out, "failed_recving", None) or ()))

    def _kv_end_step(self) -> None:
        self._kv_step += 1
        try:
            events = self._kv.take_step(self._kv_step)
            self._kv_gauges(events)
        except Exception:
            log.exception("kvmetrics could not close step %d", self._kv_step)
            return
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
                          self._kv_step)

    def _kv_gauges(self, events: StepEvents) -> None:
        me: Any = self
        waiting_status = RequestStatus.WAITING_FOR_REMOTE_KVS
        remote = sum(1 for r in me.kv_holding_waiting if r.status == waiting_status)
        events.gauges = GaugeReadings(
            kv_cache_usage=me.kv_cache_manager.usage,
            running=len(me.running),
            waiting=len(me.waiting) + len(me.kv_holding_waiting) - remote,
            waiting_for_remote_kv=remote,
            cache_blocks=me.kv_cache_manager.block_pool.num_gpu_blocks - 1,
        )
        pool = me.kv_cache_manager.block_pool
        if self._kv_step % POOL_AUDIT_EVERY and events.recovery_seconds is None:
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


class InstrumentedScheduler(InstrumentedMixin, Scheduler):
    """vLLM's synchronous scheduler plus kvmetrics counters."""


class InstrumentedAsyncScheduler(InstrumentedMixin, AsyncScheduler):
    """vLLM's async scheduler plus kvmetrics counters (``--async-scheduling``)."""
