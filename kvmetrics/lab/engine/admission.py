"""Admission of waiting requests, as vLLM 0.33's waiting scan does it.

Requests that hold blocks (async loads, landed or not) are looked at before the
plain waiting queue. Each admission does a local prefix-cache lookup and a
connector lookup, then must fit: with ``reserve_full_prompt`` (vLLM's
``scheduler_reserve_full_isl``) the blocks of all its known tokens, and an async
load also next to the blocks every prefill in flight still needs. The first
request that does not fit ends the scan, as in vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmetrics.lab.engine.outputs import SchedulerOutput
from kvmetrics.lab.engine.request import Request, RequestStatus
from kvmetrics.metrics.events import StepEvents

if TYPE_CHECKING:
    from kvmetrics.lab.engine.scheduler import Scheduler


def admit_waiting(sched: Scheduler, out: SchedulerOutput, budget: int, threshold: int,
                  events: StepEvents) -> int:
    """Admit what fits; returns the token budget left."""
    config = sched.config
    kv = sched.kv
    skipped_holding: list[Request] = []
    skipped_waiting: list[Request] = []

    def skip(queue: object) -> None:
        request = sched.kv_holding.popleft() if queue is sched.kv_holding \
            else sched.waiting.popleft()
        holds = request.num_computed_tokens > 0 \
            or request.status is RequestStatus.WAITING_FOR_REMOTE_KV
        (skipped_holding if holds else skipped_waiting).append(request)

    while budget > 0:
        queue = sched.kv_holding if sched.kv_holding else sched.waiting
        if not queue or len(sched.running) >= config.max_num_seqs:
            break
        request = queue[0]
        if request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            if request.request_id not in sched.finished_recving:
                skip(queue)
                continue
            if sched.land_async_load(request) and config.async_admission == "live":
                # Nothing of its load survived and it holds no block: it waits with
                # the requests that hold none, behind every block holder.
                skip(queue)
                continue
        if request.num_stale_output_tokens and not request.drop_stale_output:
            skip(queue)  # output of a step in flight still to deliver
            continue

        local_blocks: list = []
        local_hit = ext = 0
        is_async = False
        looked_up = request.num_computed_tokens == 0
        if looked_up:
            local_blocks, local_hit = kv.get_computed_blocks(request)
            if sched.connector is not None:
                matched, is_async = sched.connector.get_num_new_matched_tokens(
                    request, local_hit)
                if matched is None:
                    skip(queue)
                    continue
                ext = matched
                is_async = is_async and ext > 0
            if sched.historical:
                request.num_external_computed_tokens = ext
            computed = local_hit + ext
        else:
            computed = request.num_computed_tokens

        if is_async:
            n = 0
        else:
            n = request.num_tokens - computed
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget)
        reserved = sched.reserved_blocks() if is_async else 0
        full = min(request.num_tokens, config.max_model_len) if config.reserve_full_prompt else 0
        if kv.allocate_slots(request, n, local_blocks, ext, delay_cache_blocks=is_async,
                             reserved_blocks=reserved, full_sequence_tokens=full) is None:
            break
        if looked_up:
            _record_lookup(sched, request, local_hit, ext, events)
        if sched.connector is not None and ext:
            sched.connector.update_state_after_alloc(
                request, kv.block_ids(request.request_id), ext)
            request.load_mode = "async" if is_async else "sync"
        request.num_computed_tokens = computed
        request.computed_high_water = max(request.computed_high_water, computed)
        if is_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KV
            sched.inflight_prefills[request.request_id] = request
            skip(queue)
            continue
        queue.popleft()
        request.status = RequestStatus.RUNNING
        sched.running.append(request)
        if sched.historical and request.num_cached_tokens < 0:
            request.num_cached_tokens = computed
        if computed + n < request.num_tokens:
            sched.inflight_prefills[request.request_id] = request
        sched.schedule_tokens(out, request, n, events)
        budget -= n
    sched.kv_holding.extendleft(reversed(skipped_holding))
    sched.waiting.extendleft(reversed(skipped_waiting))
    return budget


def _record_lookup(sched: Scheduler, request: Request, local_hit: int, ext: int,
                   events: StepEvents) -> None:
    rid = request.request_id
    admission = "first" if request.num_lookups == 0 else "repeat"
    request.num_lookups += 1
    events.prefix_lookup("local", admission, request.num_tokens, local_hit, rid)
    if sched.connector is not None:
        queried = request.num_tokens - local_hit
        events.prefix_lookup("external", admission, queried, ext, rid)
    if not sched.historical and not request.prefill_stats_recorded \
            and request.num_preemptions == 0:
        request.prefill_stats_recorded = True
        prompt = request.num_prompt_tokens
        events.prompt_tokens("compute", prompt - local_hit - ext, rid)
        events.prompt_tokens("local_cache", local_hit, rid)
        events.prompt_tokens("external", ext, rid)
