"""Wrappers on vLLM's helper objects: the KV cache manager, its block pool, the connector.

These methods are not the scheduler's own, so they cannot be overridden by the
scheduler subclass; each is wrapped on this scheduler's instance (never on the
class, so other schedulers in the process are untouched). Every wrapper calls
vLLM's method with the same arguments and returns its result unchanged; the
metrics side goes through ``call``, which never raises into vLLM. A hook that
:mod:`kvmetrics.integrations.vllm.hooks` found unusable is not installed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import FunctionType
from typing import Any

#: ``call(hook name, recorder method, *args)``: the guarded metrics side of a hook.
Call = Callable[..., None]


def install_helper_wrappers(scheduler: Any, on: Callable[[str], bool], call: Call,
                            failed: Callable[[str], None], recorder: Any) -> None:
    """Install the usable wrappers on ``scheduler``'s cache manager, pool and connector;
    ``failed(hook)`` counts a fault the metrics side met outside ``call``. The one hook
    that runs on ordinary decode steps (a cached block evicted to make room, about once
    per request every block of tokens) skips ``call``: :func:`eviction_counter`."""
    kvm = scheduler.kv_cache_manager

    if on("kv_cache_manager.record_prefix_cache_stats"):
        record_stats = kvm.record_prefix_cache_stats

        def record_prefix_cache_stats(request: Any, num_hits: int, *args: Any,
                                      **kwargs: Any) -> Any:
            result = record_stats(request, num_hits, *args, **kwargs)
            call("kv_cache_manager.record_prefix_cache_stats", "lookup", request.request_id,
                 request.num_tokens, request.num_prompt_tokens, request.num_preemptions,
                 num_hits)
            return result

        kvm.record_prefix_cache_stats = record_prefix_cache_stats

    if on("kv_cache_manager.evict_blocks"):
        evict_blocks = kvm.evict_blocks

        def evict_blocks_hook(*args: Any, **kwargs: Any) -> Any:
            call("kv_cache_manager.evict_blocks", "set_evict_cause", "kv_load_failure")
            try:
                return evict_blocks(*args, **kwargs)
            finally:
                call("kv_cache_manager.evict_blocks", "set_evict_cause", "capacity")

        kvm.evict_blocks = evict_blocks_hook

    if on("block_pool._maybe_evict_cached_block"):
        pool = kvm.block_pool
        pool._maybe_evict_cached_block = eviction_counter(pool._maybe_evict_cached_block,
                                                          recorder, failed)

    if on("kv_cache_manager.reset_prefix_cache"):
        reset = kvm.reset_prefix_cache

        def reset_hook(*args: Any, **kwargs: Any) -> Any:
            cached = count_cached(kvm, failed)
            ok = reset(*args, **kwargs)
            if ok and cached:
                call("kv_cache_manager.reset_prefix_cache", "evicted", cached, "reset")
            return ok

        kvm.reset_prefix_cache = reset_hook

    connector = scheduler.connector
    if connector is not None and on("connector.update_state_after_alloc"):
        after_alloc = connector.update_state_after_alloc

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int,
                                     *args: Any, **kwargs: Any) -> Any:
            result = after_alloc(request, blocks, num_external_tokens, *args, **kwargs)
            block_ids: list[int] = []
            if num_external_tokens > 0:
                try:
                    block_ids = list(blocks.get_block_ids()[0])
                except Exception:
                    block_ids = []
            call("connector.update_state_after_alloc", "allocated", request.request_id,
                 block_ids, num_external_tokens)
            return result

        connector.update_state_after_alloc = update_state_after_alloc


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


def count_cached(kv_cache_manager: Any, failed: Callable[[str], None]) -> int:
    """Blocks with a prefix-cache entry (read before a reset drops them all)."""
    try:
        pool = kv_cache_manager.block_pool
        return sum(1 for b in pool.blocks if b.block_hash is not None and not b.is_null)
    except Exception:
        failed("kv_cache_manager.reset_prefix_cache")
        return 0
