"""kvmetrics' own CPU time on vLLM's scheduler thread, estimated without a clock per step.

``kvmetrics_instrumentation_cpu_seconds_total`` estimates the CPU time the instrumented
scheduler adds to vLLM's. It has three parts:

1. **Timed, every time: the work that varies.** The end of a recorded step (events,
   gauge reads, self-checks, exporters, the pool audit: every step where something
   happened and a periodic one) and the hooks on vLLM's rarer paths (admission, loads,
   preemption, finish, recovery) read the thread CPU clock around themselves on every
   call. A pair of reads sees about one read's cost, so each interval is counted with
   one more read (:attr:`Calibration.clock_ns`): the clock reads are kvmetrics' cost too.
2. **Sampled in place: the quiet step.** On a step where nothing happened the two
   overrides vLLM calls (``schedule``, ``update_from_output``) do the same few attribute
   tests and integer updates. Timing them on every step would cost more than they do,
   and a warm loop measures them several times too cheap: in a real step kvmetrics'
   objects are cold after vLLM's own work (measured 1.5-3.4 us in place against 0.6 warm
   on the VM of ``docs/benchmarks.md``). So on one step in :data:`SAMPLE_EVERY` (a fixed
   phase that never meets the periodic work, which is timed) the same inline code is
   timed with the monotonic clock (``perf_counter_ns``, a vDSO read of tens of
   nanoseconds, not a system call): from just after the step count is read to the end of
   the override, in two intervals, one each side of vLLM's own method and the hooks
   timed on their own, each less one read measured right there (:class:`QuietSamples`): the
   lesser gap of three back-to-back reads, so a thread descheduled between two of them
   does not inflate it; a sample that would still come out negative had every read
   disturbed and is left out, so no sample and no mean is ever negative. Each step is
   charged the mean of the samples so far: a systematic 1-in-64 sample of the same
   code, unbiased as long as the quiet step's cost does not vary with a 64-step period.
   The wall clock, not the thread CPU clock, bounds these intervals: a thread CPU read
   is a system call (about 590 ns against 60 for ``perf_counter_ns`` on a 2-core KVM
   guest), longer than the sub-microsecond intervals it would bound and as uncertain
   in place, while the timed parts above, tens of microseconds and more, bear it. So
   a sample over :data:`SAMPLE_MAX_NS`, about ten times the longest quiet step seen in
   place, had the thread descheduled inside it and is left out; an interruption
   shorter than that stays in its sample.
3. **Calibrated: the eviction counter.** The block pool's ``_maybe_evict_cached_block``
   wrapper runs inside vLLM's allocation loop, once per block allocated; it is charged
   per call at a cost calibrated at construction (once per process, about 1 ms: vLLM's
   call form on an instance, in a tight loop, with the real wrapper in the instance's
   dict and without).

What it cannot see: what kvmetrics costs inside vLLM's own code (vLLM's method reached
through one more frame, the cache lines kvmetrics' code and data take from vLLM's), the
call of each override itself (its frame and argument tuple, built before its first
line runs) and the step-count test that decides whether a step is sampled, which is
the first touch of the scheduler's state after vLLM's step. It is a lower bound of
what kvmetrics adds, not a measurement of it.
``benchmarks/vllm_added_cost.py`` measures the whole added cost and compares it with
this estimate.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from time import perf_counter_ns, thread_time_ns
from typing import Any

#: One step in SAMPLE_EVERY (a power of two) is timed in place, at this phase of the
#: completed-step count (never a multiple of step_end.GAUGE_EVERY, where the periodic
#: work is timed on its own).
SAMPLE_EVERY = 64
SAMPLE_PHASE = 20
#: A sampled quiet step's own part longer than this (wall clock; the part takes 1-3 us
#: in place) had the thread descheduled inside it: left out.
SAMPLE_MAX_NS = 30_000
#: Each override's sample is two intervals, one on each side of vLLM's method.
INTERVALS = 2


@dataclass(frozen=True)
class Calibration:
    """Warm-cache costs in nanoseconds, measured once per process."""

    #: What one ``thread_time_ns()`` adds to an interval it bounds (a read's full cost
    #: is about this much: part before the clock is sampled, part after).
    clock_ns: float = 0.0
    #: The block pool's eviction wrapper per call (its layer and the tallies).
    evict_ns: float = 0.0


class QuietSamples:
    """In-place timings of the quiet step's inline code, by part (0: ``schedule``'s,
    1: ``update_from_output``'s), and the mean a step is charged."""

    __slots__ = ("sums", "counts", "dropped")

    def __init__(self) -> None:
        self.sums = [0, 0]
        self.counts = [0, 0]
        self.dropped = 0

    def add(self, part: int, ns: int) -> None:
        """A sample of ``part``: the sum of its :data:`INTERVALS` clock-bounded
        intervals. Each holds about one read of the clock, measured now (the lesser of
        two back-to-back gaps: a preemption lands in one at most) and taken off. A
        sample that is left negative or too long was disturbed: dropped and counted,
        never charged."""
        first = perf_counter_ns()
        second = perf_counter_ns()
        read = min(second - first, perf_counter_ns() - second)
        ns -= INTERVALS * read
        if ns < 0 or ns > SAMPLE_MAX_NS:
            self.dropped += 1
            return
        self.sums[part] += ns
        self.counts[part] += 1

    def step_ns(self) -> float:
        """The estimated quiet-step cost (ns), both parts; 0 before any sample (no
        sample is negative, so neither is the mean)."""
        total = 0.0
        for s, n in zip(self.sums, self.counts, strict=True):
            if n:
                total += s / n
        return total


class _Tally:
    evicted_n = 0
    evict_calls = 0


class _Pool:
    """A block pool's method as vLLM's has it (``(self, block)``), evicting nothing."""

    def _maybe_evict_cached_block(self, block: Any) -> bool:
        return False


def _least_ns(loop: Any, calls: int, rounds: int) -> float:
    """The least thread CPU time per call of ``loop(calls)`` over ``rounds`` runs (the
    least is the run the rest of the machine disturbed least)."""
    best = math.inf
    for _ in range(rounds):
        t0 = thread_time_ns()
        loop(calls)
        best = min(best, thread_time_ns() - t0)
    return best / calls


_CALIBRATION: Calibration | None = None


def calibrate(calls: int = 300, rounds: int = 7) -> Calibration:
    """Measure the :class:`Calibration` (once per process)."""
    global _CALIBRATION
    if _CALIBRATION is not None:
        return _CALIBRATION
    from kvmetrics.vllm.helper_hooks import eviction_counter

    pairs = []
    for _ in range(200):
        t0 = thread_time_ns()
        pairs.append(thread_time_ns() - t0)

    # vLLM's call, ``self._maybe_evict_cached_block(block)``, with and without the
    # wrapper on the instance (as installed: helper_hooks).
    pool = _Pool()
    wrapper = eviction_counter(pool._maybe_evict_cached_block, _Tally(), lambda hook: None)

    def call(n: int) -> None:
        for _ in range(n):
            pool._maybe_evict_cached_block(None)

    def evicting(n: int) -> None:
        pool.__dict__["_maybe_evict_cached_block"] = wrapper
        call(n)
        del pool.__dict__["_maybe_evict_cached_block"]

    evict = _least_ns(evicting, calls, rounds) - _least_ns(call, calls, rounds)
    _CALIBRATION = Calibration(float(statistics.median(pairs)), max(evict, 0.0))
    return _CALIBRATION
