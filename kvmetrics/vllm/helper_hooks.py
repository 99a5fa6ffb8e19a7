"""Wrappers on vLLM's helper objects: the KV cache manager, its block pool, the connector.

These methods are not the scheduler's own, so they cannot be overridden by the
scheduler subclass; each is wrapped on this scheduler's instance (never on the
class, so other schedulers in the process are untouched). Every wrapper is built by
:func:`~.observe.wrapped` from observers of vLLM's raw arguments: vLLM's method is
called once with the arguments as given and its result returned unchanged, and everything
kvmetrics reads runs inside the guard. A hook that
:mod:`kvmetrics.vllm.hooks` found unusable is not installed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import FunctionType
from typing import Any

from kvmetrics.vllm.hooks import argument
from kvmetrics.vllm.observe import report_fault, wrapped
from kvmetrics.vllm.recorder import StepRecorder

# -- observers (see observe.py) ---------------------------------------------------------


def _lookup(kv: Any, sched: Any, seen: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
            result: Any) -> None:
    request = argument(args, kwargs, 0, "request")
    rid, local_hit = request.request_id, argument(args, kwargs, 1, "num_hits")
    track = kv.requests.get(rid)
    records_prefill = request.num_preemptions == 0 and not (track and track.prefill_recorded)
    external = track.pending_ext if track is not None and kv.has_connector else 0
    kv.lookup(rid, request.num_tokens, request.num_prompt_tokens, request.num_preemptions,
              local_hit)
    if records_prefill:
        kv.self_checks.prefill(kv.events, local_hit, external, request)


def _evicting_for_failure(kv: Any, sched: Any, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> bool:
    kv.set_evict_cause("kv_load_failure")
    return True


def _evicted_for_failure(kv: Any, sched: Any, seen: bool, args: tuple[Any, ...],
                         kwargs: dict[str, Any], result: Any) -> None:
    kv.set_evict_cause("capacity")


def _cached_blocks(kv: Any, sched: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Blocks with a prefix-cache entry (read before a reset drops them all)."""
    pool = sched.kv_cache_manager.block_pool
    return sum(1 for b in pool.blocks if b.block_hash is not None and not b.is_null)


def _reset(kv: Any, sched: Any, cached: int, args: tuple[Any, ...], kwargs: dict[str, Any],
           ok: Any) -> None:
    if ok and cached:
        kv.evicted(cached, "reset")


def _allocated(kv: Any, sched: Any, seen: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               result: Any) -> None:
    request = argument(args, kwargs, 0, "request")
    num_external = argument(args, kwargs, 2, "num_external_tokens")
    block_ids: list[int] = []
    if num_external > 0:
        block_ids = list(argument(args, kwargs, 1, "blocks").get_block_ids()[0])
    kv.allocated(request.request_id, block_ids, num_external)


def install_helper_wrappers(scheduler: Any, recorder: StepRecorder) -> None:
    """Install the wrappers of the hooks that are on (``scheduler._kv.off``) on
    ``scheduler``'s cache manager, pool and connector. The one hook that runs on
    ordinary decode steps (a cached block evicted to make room, about once per request
    every block of tokens) is not an observed call: :func:`eviction_counter`."""
    kvm = scheduler.kv_cache_manager
    off = scheduler._kv.off

    def install(owner: Any, hook: str, **observers: Any) -> None:
        if hook not in off:
            method = hook.rpartition(".")[2]
            try:
                setattr(owner, method, wrapped(scheduler, hook, getattr(owner, method),
                                               **observers))
            except Exception as e:  # not installed: off, counted, its families absent
                report_fault(scheduler, hook, f"could not be installed ({e!r})")

    install(kvm, "kv_cache_manager.record_prefix_cache_stats", after=_lookup)
    install(kvm, "kv_cache_manager.evict_blocks", before=_evicting_for_failure,
            after=_evicted_for_failure, always=True)
    install(kvm, "kv_cache_manager.reset_prefix_cache", before=_cached_blocks, after=_reset)
    if scheduler.connector is not None:
        install(scheduler.connector, "connector.update_state_after_alloc", after=_allocated)
    evict_hook = "block_pool._maybe_evict_cached_block"
    if evict_hook not in off:
        try:
            pool = kvm.block_pool
            pool._maybe_evict_cached_block = eviction_counter(
                pool._maybe_evict_cached_block, recorder,
                lambda hook: report_fault(scheduler, hook))
        except Exception as e:
            report_fault(scheduler, evict_hook, f"could not be installed ({e!r})")


def eviction_counter(maybe_evict: Callable[..., Any], recorder: Any,
                     failed: Callable[[str], None]) -> Callable[..., Any]:
    """The block pool's ``_maybe_evict_cached_block`` counting each evicted block with
    one integer increment on the recorder (``evicted_n``), no call and no clock: it runs
    once per block allocated, inside vLLM's ``schedule()``. Its cost is estimated per
    call (``evict_calls``) from a calibration of this same wrapper (:mod:`.owncost`).

    When vLLM's method takes exactly ``(self, block)`` (every supported release) the
    wrapper takes exactly ``block`` and calls vLLM's function with the pool itself: no
    argument tuple and keyword dict built per call, no bound method (about half the
    general wrapper's cost). Otherwise it passes everything through."""
    hook = "block_pool._maybe_evict_cached_block"
    function, pool = _exact_method(maybe_evict)
    if function is not None:

        def maybe_evict_hook(block: Any) -> Any:
            evicted = function(pool, block)
            try:
                recorder.evict_calls += 1
                if evicted:
                    recorder.evicted_n += 1
            except Exception:
                failed(hook)
            return evicted

        return maybe_evict_hook

    def maybe_evict_any(*args: Any, **kwargs: Any) -> Any:
        evicted = maybe_evict(*args, **kwargs)
        try:
            recorder.evict_calls += 1
            if evicted:
                recorder.evicted_n += 1
        except Exception:
            failed(hook)
        return evicted

    return maybe_evict_any


def _exact_method(bound: Callable[..., Any]) -> tuple[Any, Any]:
    """(function, instance) when ``bound`` is a plain method taking exactly ``(self,
    block)``, else (None, None)."""
    function = getattr(bound, "__func__", None)
    owner = getattr(bound, "__self__", None)
    if not isinstance(function, FunctionType) or owner is None:
        return None, None
    try:
        params = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None, None
    exact = (len(params) == 2 and params[1].name == "block"
             and all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params))
    return (function, owner) if exact else (None, None)

