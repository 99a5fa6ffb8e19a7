"""Step events from what vLLM's scheduler did, counted at the moment it did it.

The recorder holds the little per-request state the reference engine keeps on
its own requests (high-water mark of computed tokens, where its last failed
load left off, lookups done, whether prefill stats were recorded) and the loads in
flight. It is fed by the hooks in :mod:`kvmetrics.vllm.scheduler`,
each with values read at one instant, so no increment is ever a difference of
request fields updated at different times. Semantics follow
:mod:`kvmetrics.lab.engine.scheduler` and :mod:`kvmetrics.lab.engine.recovery` exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from kvmetrics.metrics.events import StepEvents

#: vLLM finish statuses (by name) to the catalogue's finish reasons.
FINISH_REASONS = {
    "FINISHED_STOPPED": "stopped",
    "FINISHED_LENGTH_CAPPED": "length",
    "FINISHED_ABORTED": "aborted",
    "FINISHED_IGNORED": "length",
    "FINISHED_ERROR": "error",
    "FINISHED_REPETITION": "stopped",
}


@dataclass
class RequestTrack:
    """What the metrics need to remember about one live request."""

    #: Highest computed count at the moment tokens were thrown away (preemption or
    #: rollback): scheduled tokens below it are recomputed. Kept only while it is
    #: ahead, so the per-step cost is proportional to requests still recomputing.
    high_water: int = 0
    #: Recomputed tokens below this mark are blamed on a failed load (the computed
    #: count just before the last rollback); above it, on preemption.
    kv_failure_until: int = 0
    lookups: int = 0
    #: Preemptions counted (checked against vLLM's own count when it finishes).
    preemptions: int = 0
    prefill_recorded: bool = False
    #: External tokens of the allocation that just succeeded (until its lookup is recorded).
    pending_ext: int = 0
    pending_block_ids: list[int] = field(default_factory=list)


@dataclass
class AsyncLoad:
    block_ids: frozenset[int]
    failed: set[int] = field(default_factory=set)


class StepRecorder:
    """Accumulates one step's events; the scheduler flushes them after each output.

    Three flags tell the scheduler's two overrides, on every step, whether there is
    anything for them to do (``schedule_work``: ``new_loads`` or ``redo`` non-empty;
    ``output_work``: ``sync_loads`` or ``async_loads`` non-empty; ``must_record``: the
    step has events or a hook fault). They are kept by every method that changes what
    they stand for, so a quiet step reads three words of this one object instead of
    four containers and the event lists (cold in memory after vLLM's own step). The
    scheduler checks ``must_record`` against the events whenever it records a step
    (``step_end``), so a path that forgot to set it is counted, not silent.
    """

    # Slots, the flags and the eviction tallies first: the words read or written on
    # every step lie together, in the object itself.
    __slots__ = ("schedule_work", "output_work", "must_record", "evict_calls", "evicted_n",
                 "evicted_any", "events", "block_size", "policy", "has_connector",
                 "schedule_hooked", "requests", "evictions", "evict_cause", "new_loads",
                 "sync_loads", "async_loads", "redo")

    def __init__(self, block_size: int, policy: str, has_connector: bool,
                 schedule_hooked: bool = True) -> None:
        self.schedule_work = False
        self.output_work = False
        self.must_record = False
        self.block_size = block_size
        self.policy = policy
        self.has_connector = has_connector
        #: Whether the scheduler's schedule() hook runs: without it nobody resolves
        #: ``new_loads`` nor walks ``redo``, so neither is filled.
        self.schedule_hooked = schedule_hooked
        self.requests: dict[str, RequestTrack] = {}
        self.events = StepEvents(step=1)
        self.evictions: dict[str, int] = {"capacity": 0, "kv_load_failure": 0, "reset": 0}
        self.evict_cause = "capacity"
        #: Blocks evicted for ``evict_cause`` not yet added to ``evictions``: the block
        #: pool's wrapper adds 1 here per evicted block (one integer increment, the only
        #: work kvmetrics does per block), folded in when the cause changes or the step
        #: is taken.
        self.evicted_n = 0
        #: Calls of the block pool's wrapper since start (kvmetrics' own CPU estimate
        #: charges its calibrated cost per call).
        self.evict_calls = 0
        #: Whether ``evictions`` holds anything not yet taken.
        self.evicted_any = False
        #: Loads whose mode is known only once schedule() returns: (rid, block ids).
        self.new_loads: list[tuple[str, list[int]]] = []
        #: Sync loads by the scheduler output that carries them.
        self.sync_loads: dict[int, list[list[int]]] = {}
        self.async_loads: dict[str, AsyncLoad] = {}
        #: Requests whose scheduled tokens may be recomputations (high-water ahead).
        self.redo: dict[str, RequestTrack] = {}

    def track(self, request_id: str) -> RequestTrack:
        track = self.requests.get(request_id)
        if track is None:
            track = self.requests[request_id] = RequestTrack()
        return track

    # -- admission ------------------------------------------------------------------

    def allocated(self, request_id: str, block_ids: list[int], num_external: int) -> None:
        track = self.track(request_id)
        track.pending_ext = num_external
        track.pending_block_ids = block_ids

    def lookup(self, request_id: str, num_tokens: int, num_prompt_tokens: int,
               num_preemptions: int, local_hit: int) -> None:
        """A prefix lookup whose allocation succeeded (reference: ``_record_lookup``)."""
        track = self.track(request_id)
        ext = track.pending_ext if self.has_connector else 0
        block_ids, track.pending_ext, track.pending_block_ids = track.pending_block_ids, 0, []
        admission = "first" if track.lookups == 0 else "repeat"
        track.lookups += 1
        ev = self.events
        self.must_record = True
        ev.prefix_lookup("local", admission, num_tokens, local_hit, request_id)
        if self.has_connector:
            ev.prefix_lookup("external", admission, num_tokens - local_hit, ext, request_id)
        if not track.prefill_recorded and num_preemptions == 0:
            track.prefill_recorded = True
            ev.prompt_tokens("compute", num_prompt_tokens - local_hit - ext, request_id)
            ev.prompt_tokens("local_cache", local_hit, request_id)
            ev.prompt_tokens("external", ext, request_id)
        if ext > 0 and self.schedule_hooked:
            bs = self.block_size
            first, end = local_hit // bs, -(-(local_hit + ext) // bs)
            self.new_loads.append((request_id, block_ids[first:end]))
            self.schedule_work = True

    def scheduled(self, output_key: int, num_scheduled: dict[str, int],
                  computed_after: Callable[[str], int], async_admitted: set[str]) -> None:
        """Close a schedule() call: load modes, and tokens scheduled again.

        ``computed_after(rid)`` is a request's computed count after this schedule
        (vLLM advances it by the scheduled tokens), so the count before is that minus
        its scheduled tokens. Only requests with a high-water mark ahead are looked at.
        """
        sync: list[list[int]] = []
        for rid, block_ids in self.new_loads:
            if rid in async_admitted:
                self.async_loads[rid] = AsyncLoad(frozenset(block_ids))
            else:
                sync.append(block_ids)
        self.new_loads = []
        if sync:
            self.sync_loads[output_key] = sync
        self.output_work = bool(self.sync_loads or self.async_loads)
        self.schedule_work = bool(self.redo)
        if not self.redo:
            return
        for rid, track in list(self.redo.items()):
            n = num_scheduled.get(rid)
            if not n:
                continue
            end = computed_after(rid)
            c = end - n
            redo_end = min(end, track.high_water)
            if redo_end > c:
                split = min(max(track.kv_failure_until, c), redo_end)
                self.events.recomputed("kv_load_failure", split - c, rid)
                self.events.recomputed("preemption", redo_end - split, rid)
                self.must_record = True
            if end >= track.high_water:
                del self.redo[rid]
        self.schedule_work = bool(self.redo)

    # -- output ---------------------------------------------------------------------

    def loads_done(self, output_key: int, invalid: set[int], finished_recving: set[str],
                   failed_recving: Collection[str] = ()) -> None:
        """Count load outcomes (reference: ``_count_loads``).

        A request in ``failed_recving`` (a connector failing a whole request's load,
        the path vLLM recommends when block ids are not unique) lost every block of
        its load: they count as failed at once, and a later ``finished_recving`` for
        it counts nothing more.
        """
        ev = self.events
        counted = False
        for block_ids in self.sync_loads.pop(output_key, ()):
            failed = sum(1 for b in block_ids if b in invalid)
            ev.loaded_blocks("sync", len(block_ids) - failed, failed)
            counted = True
        load: AsyncLoad | None
        if invalid:
            for load in self.async_loads.values():
                load.failed.update(load.block_ids & invalid)
        for rid in failed_recving:
            load = self.async_loads.pop(rid, None)
            if load is not None:
                ev.loaded_blocks("async", 0, len(load.block_ids), whole_load=True)
                counted = True
        for rid in finished_recving:
            load = self.async_loads.pop(rid, None)
            if load is not None:
                failed = len(load.failed)
                ev.loaded_blocks("async", len(load.block_ids) - failed, failed)
                counted = True
        if counted:
            self.must_record = True
        self.output_work = bool(self.sync_loads or self.async_loads)

    def rolled_back(self, mode: str, request_id: str, before: int, after: int,
                    num_scheduled: int) -> None:
        """One request truncated by the recovery path (reference: ``_truncate``)."""
        ev = self.events
        self.must_record = True
        ev.rolled_back(mode, self.policy, request_id, before, after)
        action = "failed" if self.policy == "fail" else "rescheduled"
        ev.failed_load_request(mode, self.policy, action, request_id)
        if mode == "sync":
            ev.discarded_tokens += num_scheduled
        if self.policy == "fail":
            return  # vLLM finishes it (maybe already did): nothing is recomputed
        track = self.track(request_id)
        track.kv_failure_until = before + num_scheduled
        track.high_water = max(track.high_water, before + num_scheduled)
        if self.schedule_hooked:
            self.redo[request_id] = track
            self.schedule_work = True

    def preempted(self, request_id: str, computed_before: int) -> None:
        self.must_record = True
        self.events.preempted(request_id)
        track = self.track(request_id)
        track.preemptions += 1
        track.kv_failure_until = 0
        track.high_water = max(track.high_water, computed_before)
        if self.schedule_hooked:
            self.redo[request_id] = track
            self.schedule_work = True

    def finished(self, request_id: str, status_name: str) -> None:
        self.must_record = True
        self.events.finished(FINISH_REASONS.get(status_name, "stopped"), request_id)
        self.forget(request_id)

    def forget(self, request_id: str) -> None:
        """Drop a request vLLM no longer holds (its finish was not seen: selfcheck)."""
        self.requests.pop(request_id, None)
        self.redo.pop(request_id, None)
        self.new_loads = [(r, b) for r, b in self.new_loads if r != request_id]
        self.schedule_work = bool(self.new_loads or self.redo)

    def evicted(self, n: int = 1, cause: str | None = None) -> None:
        self.evictions[cause or self.evict_cause] += n
        self.evicted_any = True

    def fold_evicted(self) -> None:
        """Move the per-block tally into ``evictions`` under the current cause."""
        n = self.evicted_n
        if n:
            self.evicted_n = 0
            self.evicted(n)

    def set_evict_cause(self, cause: str) -> None:
        self.fold_evicted()
        self.evict_cause = cause

    def merge_events(self, events: StepEvents) -> None:
        self.must_record = True
        self.events.merge(events)

    def recovery_time(self, seconds: float) -> None:
        """Time spent in vLLM's recovery path this step."""
        ev = self.events
        self.must_record = True
        ev.recovery_seconds = (ev.recovery_seconds or 0.0) + seconds

    def take_step(self, step: int) -> StepEvents:
        """The finished step's events; a fresh accumulator starts for the next one."""
        events = self.events
        events.step = step
        if self.evicted_n:
            self.fold_evicted()
        if self.evicted_any:
            self.evicted_any = False
            for cause, n in self.evictions.items():
                if n:
                    events.evicted(cause, n)
                    self.evictions[cause] = 0
        self.events = StepEvents(step=step + 1)
        self.must_record = False
        return events
