"""The KV-load recovery path, as vLLM 0.33 runs it, with events for every decision.

When a model runner reports blocks whose external load failed, each affected
request is truncated to the start of its first failed block; the tokens it had
computed before this step (``num_computed_tokens - num_scheduled_tokens``, the
unified form) minus the truncated count are rolled back. A failed block shared by
several requests is owned by the first request that reaches it; later sharers
only fall back to their pre-step count. Under policy ``fail`` the failed sync
blocks and every block after them are evicted from the prefix cache and the
requests finish with an error; under ``recompute`` nothing is evicted (the blocks
will be recomputed in place) and the requests run again.

That is vLLM 0.33's behaviour (``recovery="vllm"``, the default). It can leave
bad KV hashed: a failed block whose owner is preempted or aborted before
recomputing it, or a same-step sharer's own new blocks (docs/vllm.md).
``recovery="evict"`` is the fix the verifier argues for: every affected sync
request loses its blocks from its rollback point on, under both policies.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvmetrics.engine.request import Request, RequestStatus
from kvmetrics.metrics.events import StepEvents

if TYPE_CHECKING:
    from kvmetrics.engine.scheduler import Scheduler


def handle_invalid_blocks(
    sched: Scheduler, invalid: set[int], num_scheduled: dict[str, int], events: StepEvents
) -> set[str]:
    """Roll back affected requests; return the ids whose output this step is discarded."""
    async_reqs = [r for r in sched.kv_holding if r.status is RequestStatus.WAITING_FOR_REMOTE_KV]
    async_ids, _ = _truncate(sched, async_reqs, invalid, num_scheduled, "async", events)
    sync_ids, to_evict = _truncate(sched, sched.running, invalid, num_scheduled, "sync", events)
    if not async_ids and not sync_ids:
        return set()
    if to_evict and (sched.policy == "fail" or sched.config.recovery == "evict"):
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
    affected: set[str] = set()
    to_evict: set[int] = set()
    owned: set[int] = set()
    for request in requests:
        rid = request.request_id
        block_ids = sched.kv.block_ids(rid)
        before = request.num_computed_tokens - num_scheduled.get(rid, 0)
        n_blocks = -(-before // bs)
        is_affected = False
        truncated = False
        for idx, block_id in enumerate(block_ids[:n_blocks]):
            if block_id not in invalid:
                continue
            is_affected = True
            if block_id in owned:
                continue  # another request recomputes it; this one may keep it
            owned.add(block_id)
            if truncated:
                continue
            truncated = True
            request.num_computed_tokens = idx * bs
            if mode == "sync":
                to_evict.update(block_ids[idx:])
        if not is_affected:
            continue
        request.kv_failure_until = before + num_scheduled.get(rid, 0)
        if not truncated:
            request.num_computed_tokens = before
        affected.add(rid)
        after = request.num_computed_tokens
        if mode == "sync" and sched.config.recovery == "evict":
            _evict_from(sched, rid, after, to_evict)
        events.rolled_back(mode, sched.policy, rid, _historical_before(sched, request, mode,
                                                                       before), after)
        if sched.historical:
            request.num_external_computed_tokens -= before - after
    return affected, to_evict


def _evict_from(sched: Scheduler, request_id: str, computed: int, to_evict: set[int]) -> None:
    """The ``evict`` recovery: drop every block this request may have filled with bad KV.

    That is the block holding its first lost token and all after it, for the owner
    of a failed block and for every request that shared it in the failed step (its
    own new blocks were computed over the bad one). The cached-block count is reset
    so the recomputed blocks are offered to the prefix cache again.
    """
    keep = computed // sched.block_size
    to_evict.update(sched.kv.block_ids(request_id)[keep:])
    cached = sched.kv.num_cached_blocks
    if cached.get(request_id, 0) > keep:
        cached[request_id] = keep


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
