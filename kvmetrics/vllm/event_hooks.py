"""The instrumented scheduler's hooks on vLLM's rare paths.

Preemptions, finishes and the recovery path (failed KV loads) happen on a small share
of steps. Each hook is declared as an :class:`~.observe.Override` from its observers
(functions of vLLM's raw arguments that run inside the guard), so vLLM's method is
called once, as vLLM called it, and nothing kvmetrics evaluates can raise into it.
Each observer is timed every time it runs (:mod:`.owncost`). Each recovery call is
also cross-checked against vLLM's own count of failed requests (:mod:`.recovery_check`),
and each finish against vLLM's own count of the request's preemptions (:mod:`.selfcheck`).
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.request import RequestStatus

from kvmetrics.metrics.events import StepEvents
from kvmetrics.vllm import recovery_check
from kvmetrics.vllm.hooks import argument
from kvmetrics.vllm.observe import Override, guarded
from kvmetrics.vllm.state import OUTPUT_HOOK, InstrumentState

_ROLLBACK_HOOK = "scheduler._update_requests_with_invalid_blocks"
_PREEMPT_HOOK = "scheduler._preempt_request"

# -- observers: (kv, scheduler, args, kwargs) before, (..., seen, args, kwargs, result)
# after vLLM's method ------------------------------------------------------------------


def _computed_before_preemption(kv: InstrumentState, sched: Any, args: tuple[Any, ...],
                                kwargs: dict[str, Any]) -> int:
    return int(argument(args, kwargs, 0, "request").num_computed_tokens)


def _preempted(kv: InstrumentState, sched: Any, computed: int, args: tuple[Any, ...],
               kwargs: dict[str, Any], result: Any) -> None:
    kv.preempted(argument(args, kwargs, 0, "request").request_id, computed)


def _finishing(kv: InstrumentState, sched: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> None:
    request = argument(args, kwargs, 0, "request")
    rid = request.request_id
    if _PREEMPT_HOOK not in kv.off:
        track = kv.requests.get(rid)
        kv.self_checks.finished_preemptions(kv.events, track.preemptions if track else 0,
                                            request)
    kv.finished(rid, request.status.name)


def _recovery_start(kv: InstrumentState, sched: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> float:
    kv.recovery_tally = recovery_check.begin()
    return time.perf_counter()


def _recovery_end(kv: InstrumentState, sched: Any, start: float, args: tuple[Any, ...],
                  kwargs: dict[str, Any], result: Any) -> None:
    seconds = time.perf_counter() - start
    recovery_check.end()
    tally, kv.recovery_tally = kv.recovery_tally, None
    kv.recovery_time(seconds)
    if tally is not None and result is not None and _ROLLBACK_HOOK not in kv.off:
        kv.self_checks.compare(kv.events, recovery_check.CHECK, tally.ours, tally.vllms)


def _computed_counts(kv: InstrumentState, sched: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> dict[str, int]:
    """Every live request's computed count before the rollback. Read from vLLM's table
    of requests, not from the ``requests`` argument: vLLM passes a generator there for
    async loads, which must reach vLLM unconsumed."""
    return {rid: r.num_computed_tokens for rid, r in sched.requests.items()}


def _rolled_back(kv: InstrumentState, sched: Any, before: dict[str, int],
                 args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
    num_scheduled: dict[str, int] = argument(args, kwargs, 2, "num_scheduled_tokens", {})
    mode = "sync" if argument(args, kwargs, 3, "evict_blocks", True) else "async"
    requests = sched.requests
    tally = kv.recovery_tally
    for rid in result[0]:
        if tally is not None:
            tally.ours += 1
        scheduled = num_scheduled.get(rid, 0)
        kv.rolled_back(mode, rid, before[rid] - scheduled,
                       requests[rid].num_computed_tokens, scheduled)


def _waiting_for_kv(kv: InstrumentState, sched: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> dict[str, int]:
    failed = argument(args, kwargs, 0, "failed_req_ids", ())
    waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
    requests = sched.requests
    return {rid: requests[rid].num_computed_tokens for rid in failed
            if rid in requests and requests[rid].status == waiting}


def _failed_whole(kv: InstrumentState, sched: Any, hit: dict[str, int],
                  args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
    # vLLM resets the computed count to 0 (recompute) or fails the request.
    for rid, before in hit.items():
        kv.rolled_back("async", rid, before, 0, 0)


def _merge(kv: InstrumentState, sched: Any, events: StepEvents) -> None:
    kv.merge_events(events)


class EventHooks:
    """Overrides of vLLM's rare-path scheduler methods; part of :class:`InstrumentedMixin`."""

    _kv: InstrumentState

    _preempt_request = Override(_PREEMPT_HOOK,
                                _computed_before_preemption, _preempted)
    _free_request = Override("scheduler._free_request", _finishing)
    # Timed around vLLM's whole recovery path, also when it raised.
    _handle_invalid_blocks = Override("scheduler._handle_invalid_blocks",
                                      _recovery_start, _recovery_end, always=True)
    _update_requests_with_invalid_blocks = Override(_ROLLBACK_HOOK, _computed_counts,
                                                    _rolled_back)
    _handle_failed_recving = Override("scheduler._handle_failed_recving",
                                      _waiting_for_kv, _failed_whole)

    def kvmetrics_merge(self, events: StepEvents | None) -> None:
        """Fold a model runner's own events (verification) into the current step."""
        if events is not None:
            guarded(self, OUTPUT_HOOK, _merge, events)
