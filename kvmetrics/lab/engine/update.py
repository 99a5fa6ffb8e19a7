"""Processing a step's model output, in vLLM 0.33's order (``update_from_output``).

Deferred block frees whose fence step this output completes go back first; then
load outcomes are counted and the recovery path rolls back whoever read a failed
block (their output of this step is discarded); then each scheduled request takes
its sampled token, unless its output is stale (it was preempted or rolled back
while the step was in flight: a preempted request still gets the token, a
rolled-back one under ``async_rollback="drop"`` does not); finally failed
requests end under policy ``fail`` and finished async loads are noted.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvmetrics.lab.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvmetrics.lab.engine.recovery import handle_invalid_blocks
from kvmetrics.lab.engine.request import Request, RequestStatus
from kvmetrics.metrics.events import StepEvents

if TYPE_CHECKING:
    from kvmetrics.lab.engine.scheduler import Scheduler


def process_output(sched: Scheduler, out: SchedulerOutput, result: ModelRunnerOutput,
                   events: StepEvents) -> None:
    if result.events is not None:
        events.merge(result.events)
    if sched.defer_block_free and out.scheduled:
        sched.processed_step_seq += 1
        sched.drain_deferred_frees()
    nst = out.num_scheduled_tokens

    _count_loads(sched, out, result, events)
    affected: set[str] = set()
    if result.invalid_block_ids:
        t0 = time.perf_counter()
        affected = handle_invalid_blocks(sched, result.invalid_block_ids, nst, events)
        events.recovery_seconds = time.perf_counter() - t0

    for scheduled in out.scheduled:
        rid = scheduled.request_id
        gone = sched.finished_in_flight.get(rid)
        if gone is not None:
            gone[0] -= scheduled.num_scheduled_tokens
            if gone[0] <= 0:
                del sched.finished_in_flight[rid]
        request = sched.requests.get(rid)
        stale = False
        if request is not None:
            request.num_in_flight_tokens -= scheduled.num_scheduled_tokens
            if request.num_stale_output_tokens > 0:
                stale = True
                request.num_stale_output_tokens -= scheduled.num_scheduled_tokens
        if request is None or request.is_finished or rid in affected:
            continue
        if stale and request.drop_stale_output:
            continue
        new_tokens = result.sampled_token_ids.get(rid, [])
        if new_tokens:
            _take_tokens(sched, request, new_tokens, stale, events)

    if sched.policy == "fail" and affected:
        for rid in _vllm_set_order(affected):
            request = sched.requests.get(rid)
            if request is not None and not request.is_finished:
                sched.finish(request, RequestStatus.FINISHED_ERROR)

    for rid in set(result.finished_recving):  # the copy vLLM's KVConnectorOutput holds
        request = sched.requests.get(rid)
        if request is None:
            continue
        if request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            sched.finished_recving.add(rid)
        elif request.is_finished:
            sched.free_request_blocks(request)
            sched.requests.pop(rid, None)


def _vllm_set_order(failed: set[str]) -> set[str]:
    """The failed requests in the order vLLM ends them (and frees their blocks).

    vLLM passes them through two fresh sets into ``finish_requests``, which iterates
    a third copy: Python's set order, which depends on the string hash seed. The
    same construction here gives the same order in the same process, so a run
    matches vLLM's whatever the seed (set PYTHONHASHSEED to repeat one exactly).
    """
    from_recovery: set[str] = set()
    from_recovery.update(failed)
    errors: set[str] = set()
    errors.update(from_recovery)
    return set(errors)


def _take_tokens(sched: Scheduler, request: Request, new_tokens: list[int], stale: bool,
                 events: StepEvents) -> None:
    """Append sampled tokens, resolve placeholders, cache what the step completed."""
    if sched.historical and not request.prefill_stats_recorded:
        _record_historical_prompt_tokens(request, events)
    was_running = request.status is RequestStatus.RUNNING
    had_placeholders = request.num_output_placeholders > 0
    status = None
    for token in new_tokens:
        request.output_token_ids.append(token)
        status = sched.stop_status(request, token)
        if status is not None:
            break
    request.update_block_hashes(sched.block_size)
    if not stale and request.num_output_placeholders > 0:
        request.num_output_placeholders -= len(new_tokens)
    if not stale and was_running and had_placeholders:
        # Under async scheduling blocks are cached once the tokens they hold are known.
        ahead = (request.num_in_flight_tokens if sched.config.async_caching == "in_flight"
                 else request.num_output_placeholders)
        sched.kv.cache_blocks(request, request.num_computed_tokens - ahead)
    if status is not None:
        sched.finish(request, status)


def _count_loads(sched: Scheduler, out: SchedulerOutput, result: ModelRunnerOutput,
                 events: StepEvents) -> None:
    invalid = result.invalid_block_ids
    for load in out.loads:
        if load.mode == "sync":
            failed = sum(1 for b in load.block_ids if b in invalid)
            events.loaded_blocks("sync", len(load.block_ids) - failed, failed)
    for rid in result.finished_recving:
        pending = sched.async_loads.pop(rid, None)
        if pending is not None:
            failed = sum(1 for b in pending.block_ids if b in invalid)
            events.loaded_blocks("async", len(pending.block_ids) - failed, failed)


def _record_historical_prompt_tokens(request: Request, events: StepEvents) -> None:
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
