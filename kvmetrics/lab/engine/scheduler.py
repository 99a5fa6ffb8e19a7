"""The reference scheduler: a faithful, fast model of vLLM v1's KV path.

It schedules running requests first (chunked prefill and decode under a token
budget, preempting the most recently admitted request when blocks run out),
then admits waiting requests after a local prefix-cache lookup and a connector
lookup (:mod:`kvmetrics.lab.engine.admission`). Every step fills a :class:`StepEvents`
with what happened, counted from the events themselves; :meth:`drain_events`
hands it to the metrics layer. Output processing lives in
:mod:`kvmetrics.lab.engine.update`, the KV-load recovery path in
:mod:`kvmetrics.lab.engine.recovery`.

With ``async_scheduling`` it models vLLM's ``AsyncScheduler`` as its engine core
drives it (a batch queue of two, see :class:`kvmetrics.lab.engine.loop.EngineLoop`):
a decode step counts the token it will sample as a placeholder, so the next step
can be scheduled before this one's output is known, and with a KV connector a
request's blocks go back to the pool only once no step in flight can still write
them (vLLM's ``defer_block_free``); a victim whose blocks cannot be freed yet is
not preempted.
"""

from __future__ import annotations

from collections import deque

from kvmetrics.lab.engine.admission import admit_waiting
from kvmetrics.lab.engine.block_pool import BlockPool, KVBlock
from kvmetrics.lab.engine.config import SchedulerConfig, check_fits
from kvmetrics.lab.engine.connector import KVConnector
from kvmetrics.lab.engine.kv_cache_manager import KVCacheManager
from kvmetrics.lab.engine.outputs import (
    BlockSave,
    LoadSpec,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from kvmetrics.lab.engine.request import Request, RequestStatus
from kvmetrics.lab.engine.update import process_output
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
        #: Waiting requests that hold blocks (async loads): always looked at first.
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
        #: Outputs processed so far (a step's events are closed by its update).
        self.updates = 0
        # Deferred block frees (vLLM's defer_block_free): with a batch queue and a KV
        # connector that loads into blocks, a freed request's blocks return only once
        # every non-empty step scheduled before the free has been processed.
        self.defer_block_free = config.async_scheduling and connector is not None
        self.sched_step_seq = 0
        self.processed_step_seq = 0
        self.deferred_frees: deque[tuple[int, list[KVBlock]]] = deque()
        #: ``recovery="evict"``: block tables of requests that finished (an abort)
        #: while steps of theirs were still running, with those steps' tokens: a load
        #: such a step made may still be reported failed, with nobody left to evict it.
        self.finished_in_flight: dict[str, list] = {}
        self._finished_since_schedule: set[str] = set()
        self._events = StepEvents(step=1)
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

    def has_requests(self) -> bool:
        """Anything left for the engine loop: unfinished requests, finishes not yet
        reported to the runner, or finished requests whose blocks an async load
        still holds (vLLM's ``has_requests``)."""
        queued = len(self.running) + len(self.waiting) + len(self.kv_holding)
        return bool(queued or self._finished_since_schedule or len(self.requests) > queued)

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
        out = SchedulerOutput(step=self.step, finished_req_ids=self._finished_since_schedule)
        self._finished_since_schedule = set()
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        if len(self.running) + len(self.waiting) + len(self.kv_holding) <= 1:
            threshold = 0  # nobody to starve
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            placeholders = request.num_output_placeholders
            if placeholders and request.num_computed_tokens + 2 - placeholders \
                    >= request.num_prompt_tokens + request.max_tokens:
                i += 1  # the step in flight samples its last token
                continue
            n = request.num_tokens + placeholders - request.num_computed_tokens
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget, self.config.max_model_len - request.num_computed_tokens - 1)
            if n <= 0:
                i += 1
                continue
            allocated = False
            while True:
                if self.kv.allocate_slots(request, n) is not None:
                    allocated = True
                    break
                victim = self.running[-1]
                if not self.blocks_can_be_freed(victim):
                    break  # freeing it now would not give blocks back this step
                self.running.pop()
                self._preempt(victim, events)
                preempted.append(victim)
                if victim is request:
                    break
            if not allocated:
                break
            self.schedule_tokens(out, request, n, events)
            budget -= n
            i += 1

        if not preempted:
            admit_waiting(self, out, budget, threshold, events)

        out.preempted_req_ids = {r.request_id for r in preempted}
        if self.connector is not None:
            out.loads = self.connector.take_loads()
            for load in out.loads:
                if load.mode == "async":
                    self.async_loads[load.request_id] = load
        if self.defer_block_free and out.scheduled:
            self.sched_step_seq += 1
        self._update_after_schedule(out)
        return out

    def schedule_tokens(self, out: SchedulerOutput, request: Request, n: int,
                        events: StepEvents) -> None:
        """Add ``n`` tokens of ``request`` to the step (its count advances after the scan)."""
        c = request.num_computed_tokens
        redo_end = min(c + n, request.computed_high_water)
        if redo_end > c:
            split = min(max(request.kv_failure_until, c), redo_end)
            events.recomputed("kv_load_failure", split - c, request.request_id)
            events.recomputed("preemption", redo_end - split, request.request_id)
        block_ids = self.kv.req_block_ids[request.request_id]
        known = request.num_tokens + request.num_output_placeholders
        out.scheduled.append(ScheduledRequest(request.request_id, c, n, block_ids, known))
        if self.connector is not None:
            # Every block this step completes whose tokens are known (an async
            # scheduler may run ahead of them; the first may be partly computed).
            bs = self.block_size
            for idx in range(c // bs, min((c + n) // bs, len(request.block_hashes))):
                out.saves.append(BlockSave(request.request_id, idx, block_ids[idx],
                                           request.block_hashes[idx]))

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """Advance every scheduled request (vLLM's ``_update_after_schedule``)."""
        placeholders = self.config.async_scheduling
        for sched in out.scheduled:
            request = self.requests[sched.request_id]
            request.num_computed_tokens += sched.num_scheduled_tokens
            request.num_in_flight_tokens += sched.num_scheduled_tokens
            request.computed_high_water = max(request.computed_high_water,
                                              request.num_computed_tokens)
            if self.defer_block_free:
                request.last_sched_seq = self.sched_step_seq
            prefilling = request.num_computed_tokens < (
                request.num_tokens + request.num_output_placeholders)
            if not prefilling:
                self.inflight_prefills.pop(request.request_id, None)
                if placeholders:
                    request.num_output_placeholders += 1

    def reserved_blocks(self) -> int:
        """Blocks the prefills in flight still need (an async load must leave them free)."""
        limit = self.config.max_model_len
        return sum(self.kv.remaining_blocks(r, limit) for r in self.inflight_prefills.values())

    def land_async_load(self, request: Request) -> bool:
        """An async load reported finished: cache what is valid, then wait to run.

        Returns True when the load failed in every block, so that the request gave
        all its blocks back (the caller decides where it waits).
        """
        rid = request.request_id
        self.finished_recving.discard(rid)
        emptied = False
        if rid in self.failed_recving:
            self.failed_recving.discard(rid)
            if request.num_computed_tokens:
                self.kv.cache_blocks(request, request.num_computed_tokens)
            else:
                self.kv.free(request)
                emptied = True
                if self.config.async_admission == "live":
                    self.inflight_prefills.pop(rid, None)
        else:
            self.kv.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens -= 1
        request.status = (RequestStatus.PREEMPTED if request.num_preemptions
                          else RequestStatus.WAITING)
        return emptied

    def _preempt(self, request: Request, events: StepEvents) -> None:
        self.free_request_blocks(request)
        self.inflight_prefills.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # Output still in flight is delivered when it comes back, but leaves the
        # counts (reset just now) alone.
        request.drop_stale_output = (request.drop_stale_output
                                     and request.num_stale_output_tokens > 0)
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        request.kv_failure_until = 0
        events.preempted(request.request_id)
        self.waiting.appendleft(request)

    # -- blocks ------------------------------------------------------------------------

    def blocks_can_be_freed(self, request: Request) -> bool:
        return not self.defer_block_free or request.last_sched_seq <= self.processed_step_seq

    def free_request_blocks(self, request: Request) -> None:
        """Free a request's blocks now, or once the steps in flight that may write them
        have been processed."""
        if self.blocks_can_be_freed(request):
            self.kv.free(request)
            return
        blocks = self.kv.pop_blocks(request)
        if blocks:
            self.deferred_frees.append((self.sched_step_seq, blocks))

    def drain_deferred_frees(self) -> None:
        while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_step_seq:
            _, blocks = self.deferred_frees.popleft()
            self.pool.free_blocks(reversed(blocks))

    # -- output processing -------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        process_output(self, out, result, self._events)
        self._end_step(self._events)

    def stop_status(self, request: Request, token: int) -> RequestStatus | None:
        if request.eos_token_id is not None and token == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= request.max_tokens \
                or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request: Request, status: RequestStatus) -> None:
        self._finish(request, status)

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
        if request.num_in_flight_tokens > 0 and self.config.recovery == "evict":
            self.finished_in_flight[rid] = [request.num_in_flight_tokens,
                                            list(self.kv.block_ids(rid))]
        # A transfer still in flight may write into the blocks: keep them until the
        # runner reports the load finished (as vLLM does), or a reallocated block
        # could be overwritten under another request.
        if not (was is RequestStatus.WAITING_FOR_REMOTE_KV and rid in self.async_loads):
            self.free_request_blocks(request)
            self.requests.pop(rid, None)
        if self.connector is not None:
            self.connector.request_finished(request)
        self._finished_since_schedule.add(rid)
        self._events.finished(status.value, rid)

    def _end_step(self, events: StepEvents) -> None:
        self.updates += 1
        events.step = self.updates
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
        self._events = StepEvents(step=self.updates + 1)

    def _drain_evictions(self, events: StepEvents) -> None:
        for cause, n in self.pool.evictions.items():
            if n:
                events.evicted(cause, n)
                self.pool.evictions[cause] = 0
