"""The instrumented scheduler's hooks on vLLM's rare paths, and their fault policy.

Preemptions, finishes and the recovery path (failed KV loads) happen on a small share
of steps; each hook here is timed every time it runs (:mod:`.owncost`) and keeps the
full detail of what it saw. Whether a hook is usable was decided once at
construction (``_kv_off``, the hooks :mod:`.hooks` found broken): a broken one only
calls vLLM.

Nothing here may raise into vLLM: a fault is counted and logged once per hook
(only strict mode's :class:`CounterViolationError` passes, on purpose).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from time import thread_time_ns
from typing import Any

from vllm.v1.request import RequestStatus

from kvmetrics.integrations.vllm.exporting import LOGGER
from kvmetrics.integrations.vllm.hooks import argument
from kvmetrics.integrations.vllm.recorder import StepRecorder
from kvmetrics.metrics.events import StepEvents
from kvmetrics.metrics.guard import CounterViolationError

log = logging.getLogger(LOGGER)


def _run_guarded(owner: Any, hook: str, fn: Callable[..., None], *args: Any,
                 **kwargs: Any) -> None:
    """Run ``fn`` for ``hook``, timed; count and log its faults, never raise them (a
    guard violation in strict mode is raised: that is what strict asks for)."""
    start = thread_time_ns()
    try:
        fn(*args, **kwargs)
    except CounterViolationError:
        raise
    except Exception:
        owner._kv_hook_failed(hook)
    finally:
        owner._kv_timed(thread_time_ns() - start)


def _guarded(hook: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Run the metrics side of ``hook`` under :func:`_run_guarded`."""

    def wrap(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def run(self: Any, *args: Any, **kwargs: Any) -> None:
            _run_guarded(self, hook, fn, self, *args, **kwargs)

        return run

    return wrap


class EventHooks:
    """Overrides of vLLM's rare-path scheduler methods; part of :class:`InstrumentedMixin`."""

    _kv: StepRecorder
    _kv_off: frozenset[str]
    _kv_errors: dict[str, int]
    _kv_logged: set[str]
    _kv_cpu_ns: float
    #: One clock read (owncost.Calibration.clock_ns): a timed interval sees one of its two.
    _kv_clock_ns: int

    def _kv_timed(self, ns: int) -> None:
        """Count a timed call: its interval plus the clock read the interval missed."""
        self._kv_cpu_ns += ns + self._kv_clock_ns

    def _kv_hook_failed(self, hook: str) -> None:
        """A hook raised: count it on the endpoint, log its first fault (with traceback)."""
        self._kv_errors[hook] = self._kv_errors.get(hook, 0) + 1
        # Reported with this step (a broken recorder: the override records anyway).
        with contextlib.suppress(Exception):
            self._kv.must_record = True
        if hook not in self._kv_logged:
            self._kv_logged.add(hook)
            log.exception("kvmetrics hook %s failed; metrics may be incomplete", hook)

    def _kv_call_guarded(self, hook: str, method: str, *args: Any) -> None:
        """Call a recorder method by name for ``hook`` under :func:`_run_guarded`."""
        # The lookup too is inside the guard: a broken recorder must not reach vLLM.
        _run_guarded(self, hook, lambda: getattr(self._kv, method)(*args))

    def kvmetrics_merge(self, events: StepEvents | None) -> None:
        """Fold a model runner's own events (verification) into the current step."""
        if events is not None:
            self._kv_call_guarded("scheduler.update_from_output", "merge_events", events)

    # -- preemption and finish ---------------------------------------------------------

    def _preempt_request(self, *args: Any, **kwargs: Any) -> Any:
        hook = "scheduler._preempt_request"
        if hook in self._kv_off:
            return super()._preempt_request(*args, **kwargs)  # type: ignore[misc]
        request = argument(args, kwargs, 0, "request")
        computed = getattr(request, "num_computed_tokens", 0)
        result = super()._preempt_request(*args, **kwargs)  # type: ignore[misc]
        self._kv_call_guarded(hook, "preempted", request.request_id, computed)
        return result

    def _free_request(self, *args: Any, **kwargs: Any) -> Any:
        hook = "scheduler._free_request"
        if hook not in self._kv_off:
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
        if "scheduler._handle_invalid_blocks" in self._kv_off:
            return super()._handle_invalid_blocks(*args, **kwargs)  # type: ignore[misc]
        t0 = time.perf_counter()
        try:
            return super()._handle_invalid_blocks(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._kv_recovery_time(time.perf_counter() - t0)

    @_guarded("scheduler._handle_invalid_blocks")
    def _kv_recovery_time(self, seconds: float) -> None:
        self._kv.recovery_time(seconds)

    def _update_requests_with_invalid_blocks(self, *args: Any, **kwargs: Any) -> Any:
        hook = "scheduler._update_requests_with_invalid_blocks"
        if hook in self._kv_off:
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
        if hook in self._kv_off:
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
