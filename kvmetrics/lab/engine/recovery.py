"""The KV-load recovery path, as vLLM 0.33 runs it, with events for every decision.

When a model runner reports blocks whose external load failed, each affected
request is truncated to the start of its first failed block; the tokens it had
computed before this step (``num_computed_tokens - num_scheduled_tokens``, the
unified form) minus the truncated count are rolled back. Under async scheduling
``num_computed_tokens`` already counts the step in flight, so the rollback takes
that step's tokens back too. A failed block shared by several requests is owned
by the first request that reaches it; later sharers only fall back to their
pre-step count. Under policy ``fail`` the failed sync blocks and every block
after them are evicted from the prefix cache and the requests finish with an
error; under ``recompute`` nothing is evicted (the blocks will be recomputed in
place) and the requests run again.

That is vLLM 0.33's behaviour (``recovery="vllm"``, the default), defects
included (docs/vllm-defects.md): a failed block stays hashed under ``recompute``
and is read by the next request with that prefix when its owner is preempted or
aborted before recomputing it; a sharer keeps counting the failed block as
computed and reads it while its owner recomputes it in chunks; under ``fail`` a
sharer's own new blocks, computed over the failed one, stay hashed.

``recovery="evict"`` is the fix for all three: every affected request is rolled
back to its first failed block (sharers too, so none of them reads a block
before it was recomputed), and under both policies the blocks of every affected
sync request from there on leave the prefix cache; each block is hashed again
by exactly one of the requests that hold it, when it recomputes it, so a later
request can hit it only once it holds valid KV (vLLM asserts that a block is
never hashed twice, so the claim must be unique).

``async_rollback="drop"`` (the default) also discards the output of a step the
rolled-back request has in flight and clears its placeholders, exactly as a
preemption does; ``"vllm"`` keeps both (upstream #45138).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvmetrics.lab.engine.request import Request, RequestStatus
from kvmetrics.metrics.events import StepEvents

if TYPE_CHECKING:
    from kvmetrics.lab.engine.scheduler import Scheduler


def handle_invalid_blocks(
    sched: Scheduler, invalid: set[int], num_scheduled: dict[str, int], events: StepEvents
) -> set[str]:
    """Roll back affected requests; return the ids whose output this step is discarded."""
    async_reqs = [r for r in sched.kv_holding if r.status is RequestStatus.WAITING_FOR_REMOTE_KV]
    async_ids, _ = _truncate(sched, async_reqs, invalid, num_scheduled, "async", events)
    sync_ids, to_evict = _truncate(sched, sched.running, invalid, num_scheduled, "sync", events)
    evict = sched.config.recovery == "evict"
    if evict:
        to_evict |= _blocks_of_gone_readers(sched, invalid)
    if not async_ids and not sync_ids:
        if to_evict:
            sched.pool.evict_blocks(to_evict)
        return set()
    if to_evict and (sched.policy == "fail" or evict):
        sched.pool.evict_blocks(to_evict)
    action = "failed" if sched.policy == "fail" else "rescheduled"
    for rid in sorted(async_ids):
        events.failed_load_request("async", sched.policy, action, rid)
    for rid in sorted(sync_ids):
        events.failed_load_request("sync", sched.policy, action, rid)
        events.discarded_tokens += num_scheduled.get(rid, 0)
    if sched.policy == "fail":
        return async_ids | sync_ids
    sched.failed_recving |= async_ids
    return sync_ids


def _truncate(
    sched: Scheduler,
    requests: Iterable[Request],
    invalid: set[int],
    num_scheduled: dict[str, int],
    mode: str,
    events: StepEvents,
) -> tuple[set[str], set[int]]:
    bs = sched.block_size
    evict = sched.config.recovery == "evict"
    drop = sched.config.async_rollback == "drop"
    affected: set[str] = set()
    to_evict: set[int] = set()
    owned: set[int] = set()
    claimed: set[int] = set()
    for request in requests:
        rid = request.request_id
        block_ids = sched.kv.block_ids(rid)
        before = request.num_computed_tokens - num_scheduled.get(rid, 0)
        n_blocks = -(-before // bs)
        first = -1
        truncated = False
        for idx, block_id in enumerate(block_ids[:n_blocks]):
            if block_id not in invalid:
                continue
            if first < 0:
                first = idx
            if block_id in owned:
                continue  # another request recomputes it; this one may keep it
            owned.add(block_id)
            if truncated:
                continue
            truncated = True
            request.num_computed_tokens = idx * bs
            if mode == "sync":
                to_evict.update(block_ids[idx:])
        if first < 0:
            continue
        request.kv_failure_until = before + num_scheduled.get(rid, 0)
        if evict:
            request.num_computed_tokens = first * bs
            if mode == "sync":
                to_evict.update(block_ids[first:])
                _rehash_from(sched, rid, first, claimed)
        elif not truncated:
            # All its failed blocks are owned by others. With the output in flight
            # dropped, only tokens whose output was processed still count.
            request.num_computed_tokens = (
                request.num_computed_tokens - request.num_in_flight_tokens if drop
                else before)
        if drop:
            _drop_in_flight_output(request)
        affected.add(rid)
        after = request.num_computed_tokens
        events.rolled_back(mode, sched.policy, rid, _historical_before(sched, request, mode,
                                                                       before), after)
        if sched.historical:
            request.num_external_computed_tokens -= before - after
    return affected, to_evict


def _blocks_of_gone_readers(sched: Scheduler, invalid: set[int]) -> set[int]:
    """Blocks of requests that were aborted while the failing step ran, from their
    first failed block on: vLLM's path only looks at requests still scheduled, so
    under both policies these stay hashed with KV that was never loaded, or was
    computed over it (docs/vllm-defects.md, ``aborted-owner-keeps-failed-block``)."""
    blocks: set[int] = set()
    for _, block_ids in sched.finished_in_flight.values():
        first = next((i for i, b in enumerate(block_ids) if b in invalid), None)
        if first is not None:
            blocks.update(block_ids[first:])
    return blocks


def _rehash_from(sched: Scheduler, request_id: str, first: int, claimed: set[int]) -> None:
    """Let the request hash its blocks again from ``first`` on, once it recomputes them.

    A block that an earlier affected request already claimed (a shared prefix
    block) is hashed again by that one only: the request keeps counting it as
    cached, and starts again after the claimed run.
    """
    cached = sched.kv.num_cached_blocks
    done = cached.get(request_id, 0)
    if done <= first:
        return
    block_ids = sched.kv.block_ids(request_id)
    start = first
    while start < done and block_ids[start] in claimed:
        start += 1
    claimed.update(block_ids[start:done])
    cached[request_id] = start


def _drop_in_flight_output(request: Request) -> None:
    """Treat the output of the steps in flight like a preemption's: it is discarded.

    It was computed over the failed block, or at positions the rollback takes
    back; the current step's share is drained (and skipped) in this very update.
    """
    request.num_stale_output_tokens = request.num_in_flight_tokens
    request.drop_stale_output = request.num_in_flight_tokens > 0
    request.num_output_placeholders = 0


def _historical_before(sched: Scheduler, request: Request, mode: str, before: int) -> int:
    """The pre-step computed count as the old code derived it (historical accounting).

    The old path used ``num_cached_tokens`` for sync loads and the allocated
    blocks for async loads; both can disagree with what was really computed.
    """
    if not sched.historical:
        return before
    if mode == "sync":
        return request.num_cached_tokens
    return len(sched.kv.block_ids(request.request_id)) * sched.block_size
