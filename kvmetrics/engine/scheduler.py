"""The reference scheduler: a faithful, fast model of vLLM v1's KV path.

It schedules running requests first (chunked prefill and decode under a token
budget, preempting the most recently admitted request when blocks run out),
then admits waiting requests after a local prefix-cache lookup and a connector
lookup. Every step fills a :class:`StepEvents` with what happened, counted from
the events themselves; :meth:`drain_events` hands it to the metrics layer.
The KV-load recovery path lives in :mod:`kvmetrics.engine.recovery`.
"""

from __future__ import annotations

import time
from collections import deque

from kvmetrics.engine.block_pool import BlockPool
from kvmetrics.engine.config import SchedulerConfig, check_fits
from kvmetrics.engine.connector import KVConnector
from kvmetrics.engine.kv_cache_manager import KVCacheManager
from kvmetrics.engine.outputs import (
    BlockSave,
    LoadSpec,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from kvmetrics.engine.recovery import handle_invalid_blocks
from kvmetrics.engine.request import Request, RequestStatus
from kvmetrics.metrics.events import GaugeReadings, PoolSnapshot, StepEvents


class Scheduler:
    def __init__(self, config: SchedulerConfig, connector: KVConnector | None = None) -> None:
        self.config = config
        self.block_size = config.block_size
        self.policy = config.kv_load_failure_policy
        self.historical = config.accounting == "historical"
        self.pool = BlockPool(config.num_gpu_blocks)
        self.kv = KVCacheManager(self.pool, config.block_size, config.enable_prefix_caching)
        self.connector = connector
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        #: Requests that hold blocks while waiting (async loads in flight).
        self.kv_holding: deque[Request] = deque()
        self.running: list[Request] = []
        #: Requests whose prefill is still in progress (async loads included): an
        #: async load is admitted only if their remaining blocks stay free, as in
        #: vLLM, or loads could take every block while nothing can run.
        self.inflight_prefills: dict[str, Request] = {}
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        #: Async loads in flight, by request, for counting their blocks on completion.
        self.async_loads: dict[str, LoadSpec] = {}
        self.step = 0
        self._finished_since_schedule: set[str] = set()
        self._events = StepEvents(step=0)
        self._ready: list[StepEvents] = []

    # -- public API ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        check_fits(request.request_id, request.num_prompt_tokens, request.max_tokens,
                   self.config)
        request.update_block_hashes(self.block_size)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.kv_holding)

    def drain_events(self) -> list[StepEvents]:
        """Events of every step completed since the last call, oldest first."""
        ready, self._ready = self._ready, []
        return ready

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset_prefix_cache()
        self._drain_evictions(self._events)
        return ok

    # -- scheduling ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.step += 1
        events = self._events
        events.step = self.step
        out = SchedulerOutput(step=self.step, finished_req_ids=self._finished_since_schedule)
        self._finished_since_schedule = set()
        budget = self.config.max_num_batched_tokens
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget,
                    self.config.max_model_len - request.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            while True:
                if self.kv.allocate_slots(request, n) is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim, events)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            self._schedule_tokens(out, request, n, events)
            budget -= n
            i += 1

        if not preempted:
            budget = self._admit_waiting(out, budget, events)

        out.preempted_req_ids = {r.request_id for r in preempted}
        if self.connector is not None:
            out.loads = self.connector.take_loads()
            for load in out.loads:
                if load.mode == "async":
                    self.async_loads[load.request_id] = load
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, events: StepEvents) -> int:
        skipped_holding: list[Request] = []
        skipped_waiting: list[Request] = []
        while budget > 0:
            queue = self.kv_holding if self.kv_holding else self.waiting
            if not queue or len(self.running) >= self.config.max_num_seqs:
                break
            request = queue[0]
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                if request.request_id not in self.finished_recving:
                    queue.popleft()
                    skipped_holding.append(request)
                    continue
                self._land_async_load(request)

            local_blocks: list = []
            local_hit = ext = 0
            is_async = False
            looked_up = request.num_computed_tokens == 0
            if looked_up:
                local_blocks, local_hit = self.kv.get_computed_blocks(request)
                if self.connector is not None:
                    matched, is_async = self.connector.get_num_new_matched_tokens(
                        request, local_hit)
                    if matched is None:
                        queue.popleft()
                        (skipped_holding if request in self.kv_holding else skipped_waiting
                         ).append(request)
                        continue
                    ext = matched
                    is_async = is_async and ext > 0
                if self.historical:
                    request.num_external_computed_tokens = ext
                computed = local_hit + ext
            else:
                computed = request.num_computed_tokens

            n = 0 if is_async else min(request.num_tokens - computed, budget)
            reserved = self._reserved_blocks(request) if is_async else 0
            if self.kv.allocate_slots(request, n, local_blocks, ext,
                                      delay_cache_blocks=is_async,
                                      reserved_blocks=reserved) is None:
                if reserved and queue is self.kv_holding \
                        and self.config.async_admission == "live":
                    # Refused for blocks held back for loads that may sit behind it in
                    # this queue: stopping here would keep them from ever landing.
                    queue.popleft()
                    skipped_holding.append(request)
                    continue
                break
            queue.popleft()
            if looked_up:
                self._record_lookup(request, local_hit, ext, events)
            if self.connector is not None and ext:
                self.connector.update_state_after_alloc(
                    request, self.kv.block_ids(request.request_id), ext)
                request.load_mode = "async" if is_async else "sync"
            request.num_computed_tokens = computed
            request.computed_high_water = max(request.computed_high_water, computed)
            if is_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KV
                self.inflight_prefills[request.request_id] = request
                skipped_holding.append(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if self.historical and request.num_cached_tokens < 0:
                request.num_cached_tokens = computed
            self._schedule_tokens(out, request, n, events)
            budget -= n
        self.kv_holding.extendleft(reversed(skipped_holding))
        self.waiting.extendleft(reversed(skipped_waiting))
        return budget

    def _reserved_blocks(self, admitting: Request) -> int:
        """Blocks other in-flight prefills still need (a request never waits on itself)."""
        limit = self.config.max_model_len
        if self.config.async_admission == "vllm":
            return sum(self.kv.remaining_blocks(r, limit)
                       for r in self.inflight_prefills.values())
        return sum(self.kv.remaining_blocks(r, limit) for r in self.inflight_prefills.values()
                   if r is not admitting)

    def _land_async_load(self, request: Request) -> None:
        """An async load reported finished: cache what is valid, then wait to run."""
        rid = request.request_id
        self.finished_recving.discard(rid)
        if rid in self.failed_recving:
            self.failed_recving.discard(rid)
            if request.num_computed_tokens:
                self.kv.cache_blocks(request, request.num_computed_tokens)
            else:
                self.kv.free(request)
                if self.config.async_admission == "live":
                    self.inflight_prefills.pop(rid, None)
        else:
            self.kv.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens -= 1
        request.status = (RequestStatus.PREEMPTED if request.num_preemptions
                          else RequestStatus.WAITING)

    def _record_lookup(self, request: Request, local_hit: int, ext: int,
                       events: StepEvents) -> None:
        rid = request.request_id
        admission = "first" if request.num_lookups == 0 else "repeat"
        request.num_lookups += 1
        events.prefix_lookup("local", admission, request.num_tokens, local_hit, rid)
        if self.connector is not None:
            queried = request.num_tokens - local_hit
            events.prefix_lookup("external", admission, queried, ext, rid)
        if not self.historical and not request.prefill_stats_recorded \
                and request.num_preemptions == 0:
            request.prefill_stats_recorded = True
            prompt = request.num_prompt_tokens
            events.prompt_tokens("compute", prompt - local_hit - ext, rid)
            events.prompt_tokens("local_cache", local_hit, rid)
            events.prompt_tokens("external", ext, rid)

    def _schedule_tokens(self, out: SchedulerOutput, request: Request, n: int,
                         events: StepEvents) -> None:
        c = request.num_computed_tokens
        redo_end = min(c + n, request.computed_high_water)
        if redo_end > c:
            split = min(max(request.kv_failure_until, c), redo_end)
            events.recomputed("kv_load_failure", split - c, request.request_id)
            events.recomputed("preemption", redo_end - split, request.request_id)
        block_ids = self.kv.req_block_ids[request.request_id]
        out.scheduled.append(ScheduledRequest(
            request.request_id, c, n, block_ids, request.num_tokens,
            is_prefill=c < request.num_prompt_tokens))
        if self.connector is not None:
            # Every block this step completes (the first may be partly computed already).
            bs = self.block_size
            for idx in range(c // bs, (c + n) // bs):
                out.saves.append(BlockSave(request.request_id, idx, block_ids[idx],
                                           request.block_hashes[idx]))
        request.num_computed_tokens = c + n
        request.computed_high_water = max(request.computed_high_water, c + n)
        if c + n < request.num_tokens:
            self.inflight_prefills[request.request_id] = request
        else:
            self.inflight_prefills.pop(request.request_id, None)

    def _preempt(self, request: Request, events: StepEvents) -> None:
        self.kv.free(request)
        self.inflight_prefills.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.kv_failure_until = 0
        events.preempted(request.request_id)
        self.waiting.appendleft(request)

    # -- output processing -------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        events = self._events
        if result.events is not None:
            events.merge(result.events)
        nst = out.num_scheduled_tokens

        self._count_loads(out, result, events)
        affected: set[str] = set()
        if result.invalid_block_ids:
            t0 = time.perf_counter()
            affected = handle_invalid_blocks(self, result.invalid_block_ids, nst, events)
            events.recovery_seconds = time.perf_counter() - t0

        for sched in out.scheduled:
            rid = sched.request_id
            request = self.requests.get(rid)
            if request is None or request.is_finished or rid in affected:
                continue
            new_tokens = result.sampled_token_ids.get(rid, [])
            if not new_tokens:
                continue
            if self.historical and not request.prefill_stats_recorded:
                self._record_historical_prompt_tokens(request, events)
            for token in new_tokens:
                request.output_token_ids.append(token)
                status = self._stop_status(request, token)
                if status is not None:
                    request.update_block_hashes(self.block_size)
                    self._finish(request, status)
                    break
            else:
                request.update_block_hashes(self.block_size)

        if self.policy == "fail":
            for rid in sorted(affected):
                request = self.requests.get(rid)
                if request is not None and not request.is_finished:
                    self._finish(request, RequestStatus.FINISHED_ERROR)

        for rid in result.finished_recving:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
                self.finished_recving.add(rid)
            elif request.is_finished:
                self.kv.free(request)
                self.requests.pop(rid, None)

        self._end_step(events)

    def _count_loads(self, out: SchedulerOutput, result: ModelRunnerOutput,
                     events: StepEvents) -> None:
        invalid = result.invalid_block_ids
        for load in out.loads:
            if load.mode == "sync":
                failed = sum(1 for b in load.block_ids if b in invalid)
                events.loaded_blocks("sync", len(load.block_ids) - failed, failed)
        for rid in result.finished_recving:
            load = self.async_loads.pop(rid, None)
            if load is not None:
                failed = sum(1 for b in load.block_ids if b in invalid)
                events.loaded_blocks("async", len(load.block_ids) - failed, failed)

    def _record_historical_prompt_tokens(self, request: Request, events: StepEvents) -> None:
        """The pre-fix formula, on purpose: it goes negative in known scenarios."""
        request.prefill_stats_recorded = True
        prompt = request.num_prompt_tokens
        cached = request.num_cached_tokens
        recomputed = 1 if cached + 1 == prompt else 0
        rid = request.request_id
        events.prompt_tokens("compute", prompt - cached, rid)
        events.prompt_tokens("external", request.num_external_computed_tokens, rid)
        events.prompt_tokens(
            "local_cache", cached + recomputed - request.num_external_computed_tokens, rid)

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        if request.eos_token_id is not None and token == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= request.max_tokens \
                or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        rid = request.request_id
        was = request.status
        request.status = status
        if was is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.kv_holding:
            self.kv_holding.remove(request)
        self.finished_recving.discard(rid)
        self.failed_recving.discard(rid)
        self.inflight_prefills.pop(rid, None)
        # A transfer still in flight may write into the blocks: keep them until the
        # runner reports the load finished (as vLLM does), or a reallocated block
        # could be overwritten under another request.
        if not (was is RequestStatus.WAITING_FOR_REMOTE_KV and rid in self.async_loads):
            self.kv.free(request)
            self.requests.pop(rid, None)
        if self.connector is not None:
            self.connector.request_finished(request)
        self._finished_since_schedule.add(rid)
        self._events.finished(status.value, rid)

    def _end_step(self, events: StepEvents) -> None:
        self._drain_evictions(events)
        waiting_remote = sum(1 for r in self.kv_holding
                             if r.status is RequestStatus.WAITING_FOR_REMOTE_KV)
        events.gauges = GaugeReadings(
            kv_cache_usage=self.pool.usage(),
            running=len(self.running),
            waiting=len(self.waiting) + len(self.kv_holding) - waiting_remote,
            waiting_for_remote_kv=waiting_remote,
            cache_blocks=self.pool.num_blocks - 1,
        )
        events.pool = PoolSnapshot(
            free_blocks=self.pool.num_free_blocks,
            used_blocks=self.pool.num_used_blocks,
            total_blocks=self.pool.num_blocks - 1,
            negative_ref_counts=self.pool.negative_ref_counts,
        )
        self.pool.negative_ref_counts = 0
        self._ready.append(events)
        self._events = StepEvents(step=self.step + 1)

    def _drain_evictions(self, events: StepEvents) -> None:
        for cause, n in self.pool.evictions.items():
            if n:
                events.evicted(cause, n)
                self.pool.evictions[cause] = 0
