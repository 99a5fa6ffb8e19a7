"""A protective recovery path for vLLM's real scheduler: opt-in, off by default.

``KVMETRICS_RECOVERY=evict`` (or ``--additional-config '{"kvmetrics":
{"recovery": "evict"}}'``) makes the instrumented scheduler fix the
recovery-path defects of vLLM 0.33 and 0.34 that ``kvmetrics vllm-check`` reports
(docs/vllm-defects.md), with the same rules as the reference engine's
``recovery="evict"``, ``async_admission="live"`` and ``async_rollback="drop"``:

- every request that read a failed block is rolled back to that block, sharers
  included (a sharer otherwise keeps counting it as computed and reads it while
  its owner recomputes it in chunks);
- under both policies the blocks of every affected running request from its
  rollback point on leave the prefix cache (under ``recompute`` vLLM keeps them
  hashed, and the next request with that prefix reads KV that was never loaded
  once the owner is preempted or aborted; under ``fail`` it forgets the sharers'
  own blocks), and each is hashed again by one of its holders when recomputed;
- a step the rolled-back request has in flight (async scheduling) has its output
  discarded and its placeholders cleared, as a preemption does;
- a request whose async load failed in every block leaves the in-flight prefills
  (0.33) or the parked reservations (0.34) and the queue of block holders, so its
  own reservation can no longer stall it;
- a request aborted while a step of it still runs keeps its block table on record
  until that step's output is processed, so that if its load failed its blocks
  from the failed one on are evicted too (vLLM only looks at requests still
  scheduled, under either policy).

With the setting off (the default) :class:`ProtectMixin` is not in the scheduler's
class at all (the instrumented scheduler picks its class at construction, see
:func:`protected_over`): vLLM's own methods run, with no pass-through layer, and
observing never changes vLLM's decisions unless asked to.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kvmetrics.metrics.text import short_repr, short_text
from kvmetrics.vllm import fingerprints
from kvmetrics.vllm.exporting import LOGGER
from kvmetrics.vllm.hooks import Hook, argument, signature_problem, vllm_base

log = logging.getLogger(LOGGER)

RECOVERIES = ("vllm", "evict")

#: vLLM's scheduler methods the fix overrides, with the leading parameters its
#: overrides read. Checked at startup when the fix is on; when it is off the fix is
#: not in the class, so a changed signature cannot break a scheduler that only observes.
PROTECTED: tuple[Hook, ...] = (
    Hook("scheduler", "_update_requests_with_invalid_blocks",
         ("requests", "invalid_block_ids", "num_scheduled_tokens", "evict_blocks"), ()),
    Hook("scheduler", "_handle_invalid_blocks", ("invalid_block_ids", "num_scheduled_tokens"),
         ()),
    Hook("scheduler", "_free_request", ("request",), ()),
    Hook("scheduler", "update_from_output", ("scheduler_output", "model_runner_output"), ()),
    Hook("scheduler", "_update_waiting_for_remote_kv", ("request",), ()),
    Hook("scheduler", "_handle_blocked_waiting_request", ("request",), ()),
)


def recovery_setting(vllm_config: Any, env: Mapping[str, str] | None = None) -> str:
    """``KVMETRICS_RECOVERY``, overridden by ``additional_config["kvmetrics"]["recovery"]``."""
    env = os.environ if env is None else env
    value: Any = env.get("KVMETRICS_RECOVERY", "vllm")
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and isinstance(extra.get("kvmetrics"), dict):
        ours = extra["kvmetrics"].get("recovery")
        value = value if ours is None else ours  # null: not set here
    if not isinstance(value, str):  # before the settings' own check: this runs first
        raise ValueError(f"kvmetrics: additional_config.kvmetrics.recovery must be a string, "
                         f"got {type(value).__name__} {short_repr(value, 40)}")
    choice = value.strip().lower() or "vllm"
    if choice not in RECOVERIES:
        raise ValueError(f"KVMETRICS_RECOVERY must be one of {', '.join(RECOVERIES)}, "
                         f"got {short_text(choice, 40)!r}")
    return choice


def protect_decided(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the scheduler built with these arguments runs the fix (``vllm_config``
    passed as vLLM passes it); a setting that is not a recovery raises ValueError."""
    return recovery_setting(kwargs.get("vllm_config", args[0] if args else None)) == "evict"


_PROTECTED: dict[type, type] = {}


def protected_over(cls: type) -> type:
    """``cls`` with the fix between its kvmetrics layers and vLLM's scheduler class.

    ``cls`` is an instrumented class (kvmetrics' mixins over vLLM's class B). The result
    is a subclass of ``cls`` whose MRO reads ``cls ... kvmetrics' hooks, ProtectMixin,
    B``: the hooks observe what the fix does, as they observe vLLM. Made once per class,
    under ``cls``'s own name (logs and reprs name the class the operator named).
    """
    made = _PROTECTED.get(cls)
    if made is None:
        base = vllm_base(cls)
        fixed = _PROTECTED.get(base)
        if fixed is None:
            fixed = _PROTECTED[base] = type(
                f"Protected{base.__name__}", (ProtectMixin, base),
                {"__module__": __name__, "__doc__": ProtectMixin.__doc__})
        made = _PROTECTED[cls] = type(cls.__name__, (cls, fixed),
                                      {"__module__": cls.__module__, "__doc__": cls.__doc__})
    return made


if TYPE_CHECKING:  # the mixin's super() is vLLM's scheduler: checked as such
    from vllm.v1.core.sched.scheduler import Scheduler as _SchedulerBase
else:
    _SchedulerBase = object


class ProtectMixin(_SchedulerBase):
    """The fixes, mixed into vLLM's Scheduler or AsyncScheduler (after the hooks).

    Only in the class when the fix is on (:func:`protected_over`): every override here
    runs the fix unconditionally.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        me: Any = self
        self.kvmetrics_recovery = recovery_setting(me.vllm_config)
        self._protect_evict: set[int] = set()
        self._protect_emptied: Any = None
        #: Requests that finished with steps in flight: [tokens in flight, block ids].
        self._protect_gone: dict[str, list[Any]] = {}
        #: How this vLLM compares with the versions kvmetrics was verified on.
        self.kvmetrics_vllm = fingerprints.check_safely()
        if self.kvmetrics_recovery != "evict":
            # The class was chosen for another setting: refuse rather than fix unasked.
            raise RuntimeError("kvmetrics: the protective recovery was built into a "
                               "scheduler whose setting is KVMETRICS_RECOVERY="
                               f"{self.kvmetrics_recovery}")
        refusal = fingerprints.protect_allowed(self.kvmetrics_vllm)
        if refusal is not None:
            raise RuntimeError(refusal)
        if not (self.kvmetrics_vllm.verified and self.kvmetrics_vllm.protect_verified):
            log.warning("kvmetrics: KVMETRICS_RECOVERY=evict runs on unverified vLLM code "
                        "because %s=1: %s", fingerprints.ALLOW_UNVERIFIED,
                        self.kvmetrics_vllm.summary())
        # Fail at startup, not at the first failed load, if vLLM's internals moved.
        managers = me.kv_cache_manager.coordinator.single_type_managers
        if len(managers) != 1 or not hasattr(managers[0], "num_cached_block") \
                or not hasattr(me, "_inflight_prefills") \
                or (hasattr(me, "_parked_reservations")
                    and not hasattr(me, "_unreserve_parked")):
            raise RuntimeError("KVMETRICS_RECOVERY=evict supports one KV cache group on "
                               "vLLM 0.32-0.34's scheduler internals only")
        base = vllm_base(type(self))
        for hook in PROTECTED:
            problem = signature_problem(getattr(base, hook.method, None), hook, True)
            if problem is not None:
                raise RuntimeError(f"KVMETRICS_RECOVERY=evict cannot run on this vLLM: "
                                   f"{hook.name} {problem}")

    # -- sync and async rollbacks ------------------------------------------------------

    def _update_requests_with_invalid_blocks(self, *args: Any, **kwargs: Any) -> Any:
        return self._protect_rollback(*args, **kwargs)

    def _protect_rollback(self, requests: Iterable[Any], invalid_block_ids: set[int],
                          num_scheduled_tokens: dict[str, int], evict_blocks: bool = True,
                          ) -> tuple[set[str], int, set[int]]:
        me: Any = self
        bs = me.block_size
        cached = me.kv_cache_manager.coordinator.single_type_managers[0].num_cached_block
        affected: set[str] = set()
        total = 0
        to_evict: set[int] = set()
        claimed: set[int] = set()
        for request in requests:
            rid = request.request_id
            (block_ids,) = me.kv_cache_manager.get_block_ids(rid)
            before = request.num_computed_tokens - num_scheduled_tokens.get(rid, 0)
            n_blocks = -(-before // bs)
            first = next((i for i, b in enumerate(block_ids[:n_blocks])
                          if b in invalid_block_ids), None)
            if first is None:
                continue
            request.num_computed_tokens = first * bs
            total += before - first * bs
            if evict_blocks:
                to_evict.update(block_ids[first:])
                _rehash_from(cached, rid, block_ids, first, claimed)
            # The output of steps in flight was computed over the failed block or at
            # positions just taken back: discard it when it comes, as for a preemption.
            request.num_stale_output_tokens = request.num_in_flight_tokens
            request.drop_stale_output = request.num_in_flight_tokens > 0
            request.num_output_placeholders = 0
            affected.add(rid)
        if evict_blocks:
            self._protect_evict |= to_evict
        return affected, total, to_evict

    def _handle_invalid_blocks(self, *args: Any, **kwargs: Any) -> Any:
        invalid_block_ids: set[int] = argument(args, kwargs, 0, "invalid_block_ids")
        me: Any = self
        self._protect_evict = set()
        try:
            result = super()._handle_invalid_blocks(*args, **kwargs)
            # Under "fail" vLLM evicts them itself; under "recompute" it would not.
            if self._protect_evict and me.recompute_kv_load_failures:
                me.kv_cache_manager.evict_blocks(self._protect_evict)
            gone: set[int] = set()
            for _, block_ids in self._protect_gone.values():
                first = next((i for i, b in enumerate(block_ids) if b in invalid_block_ids),
                             None)
                if first is not None:
                    gone.update(block_ids[first:])
            if gone:
                me.kv_cache_manager.evict_blocks(gone)
        finally:
            self._protect_evict = set()
        return result

    # -- requests that end while a step of theirs still runs ---------------------------

    def _free_request(self, *args: Any, **kwargs: Any) -> Any:
        request = argument(args, kwargs, 0, "request")
        if request.num_in_flight_tokens > 0:
            me: Any = self
            (block_ids,) = me.kv_cache_manager.get_block_ids(request.request_id)
            self._protect_gone[request.request_id] = [request.num_in_flight_tokens,
                                                      list(block_ids)]
        return super()._free_request(*args, **kwargs)

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        # Records made while this output is processed already left its tokens out.
        recorded = list(self._protect_gone)
        result = super().update_from_output(*args, **kwargs)
        scheduled = argument(args, kwargs, 0, "scheduler_output").num_scheduled_tokens
        for rid in recorded:
            record = self._protect_gone.get(rid)
            if record is not None and rid in scheduled:
                record[0] -= scheduled[rid]
                if record[0] <= 0:
                    del self._protect_gone[rid]
        return result

    # -- async loads that failed in every block ----------------------------------------

    def _update_waiting_for_remote_kv(self, *args: Any, **kwargs: Any) -> Any:
        me: Any = self
        request = argument(args, kwargs, 0, "request")
        emptied = (request.request_id in me.failed_recving_kv_req_ids
                   and not request.num_computed_tokens)
        result = super()._update_waiting_for_remote_kv(*args, **kwargs)
        if emptied:
            me._inflight_prefills.discard(request)
            self._protect_emptied = request
        return result

    def _handle_blocked_waiting_request(self, *args: Any, **kwargs: Any) -> Any:
        ready = super()._handle_blocked_waiting_request(
            *args, **kwargs)
        request = argument(args, kwargs, 0, "request")
        if self._protect_emptied is request:
            self._protect_emptied = None
            # vLLM 0.34 reserves blocks for it again right after promoting it
            # (``_reserve_parked``): a request that holds none is a new request, and
            # its own reservation would count against it. Up to 0.33 the discard in
            # ``_update_waiting_for_remote_kv`` was enough.
            me: Any = self
            me._inflight_prefills.discard(request)
            unreserve = getattr(me, "_unreserve_parked", None)
            if unreserve is not None:
                unreserve(request)
            # It holds no block any more: skipped now, it waits in the plain queue,
            # behind every request that holds blocks.
            return False
        return ready


def _rehash_from(cached: dict[str, int], request_id: str, block_ids: list[int], first: int,
                 claimed: set[int]) -> None:
    """Hash the request's blocks again from ``first`` once recomputed; a shared block
    an earlier request claimed is hashed by that one only (vLLM asserts a block is
    never hashed twice)."""
    done = cached.get(request_id, 0)
    if done <= first:
        return
    start = first
    while start < done and block_ids[start] in claimed:
        start += 1
    claimed.update(block_ids[start:done])
    cached[request_id] = start
