"""kvmetrics' own CPU time on vLLM's scheduler thread, estimated without a clock per step.

``kvmetrics_instrumentation_cpu_seconds_total`` is an estimate of the CPU time the
instrumented scheduler adds to vLLM's, built from three parts:

1. **The override bodies, sampled.** Each call of ``schedule()`` and of
   ``update_from_output()`` is timed independently with probability 1/SAMPLE_EVERY
   (a geometric countdown, :class:`Sampler`). A timed call reads the thread CPU clock
   around its own work before and after vLLM's call (never across it), subtracts what
   the clock reads themselves put in the interval (:attr:`Calibration.clock_ns`, one per
   pair) and counts the rest SAMPLE_EVERY times: each call is counted with weight
   1/probability when sampled, so the sum is an unbiased estimate (Horvitz-Thompson) of
   the bodies' total on every call, gauge reads and the pool audit included. The clock
   reads a timed call makes are real cost of that call only: counted once, not scaled.
2. **What no clock in the body can see, calibrated.** Entering an override, its
   ``*args, **kwargs`` packing, the countdown, ``super()`` and the return happen outside
   the timed intervals, and the block pool's eviction wrapper runs inside vLLM's call.
   At construction the same shapes are timed in a tight loop
   (:func:`calibrate`): the cost of one pass-through layer, charged twice per step
   (two overrides), and of the eviction wrapper, charged per evicted block.
3. **The rare hooks, timed.** Admission, preemption, finish and recovery hooks run
   inside vLLM's own calls; each call is timed and counted once, plus one clock read
   (a pair of reads sees one of its two reads).

What it cannot see: calibrations are warm-cache figures, and the cost kvmetrics imposes
on vLLM's own code by evicting vLLM's code and data from the CPU caches between calls
is in vLLM's time, not kvmetrics'. On a busy machine that share can dominate; the
benchmark ``benchmarks/vllm_added_cost.py`` measures the whole and compares.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from time import thread_time_ns
from typing import Any

#: One call in SAMPLE_EVERY (on average) reads the clock.
SAMPLE_EVERY = 64


class Sampler:
    """Geometric gaps between timed calls: each call timed independently with
    probability 1/SAMPLE_EVERY (so which calls are timed never depends on what they do)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def gap(self) -> int:
        """Calls until the next timed one (1: the next call)."""
        if SAMPLE_EVERY <= 1:
            return 1
        u = 1.0 - self._rng.random()  # in (0, 1]
        return int(math.log(u) / math.log(1.0 - 1.0 / SAMPLE_EVERY)) + 1


@dataclass(frozen=True)
class Calibration:
    """Warm-cache costs in nanoseconds, measured once per process."""

    #: What one ``thread_time_ns()`` adds to an interval it bounds (a read's full cost
    #: is about this much: half before the clock is sampled, half after).
    clock_ns: float = 0.0
    #: One pass-through override layer, outside its timed intervals.
    layer_ns: float = 0.0
    #: The block pool's eviction wrapper per evicted block (its layer and the tally).
    evict_ns: float = 0.0


class _Base:
    def step(self, a: Any, b: Any = None) -> Any:
        return a


class _Layer(_Base):
    """The shape of an override outside its timed intervals: one flag, the countdown,
    ``super()`` with ``*args, **kwargs``."""

    off = False
    left = 1 << 60

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if self.off:
            return None
        self.left -= 1
        return super().step(*args, **kwargs)


class _Tally:
    evicted_n = 0


def _loop_ns(fn: Any, calls: int, rounds: int) -> float:
    """The least thread CPU time per call of ``fn(1, 2)`` over ``rounds`` loops."""
    best = math.inf
    for _ in range(rounds):
        t0 = thread_time_ns()
        for _ in range(calls):
            fn(1, 2)
        best = min(best, thread_time_ns() - t0)
    return best / calls


_CALIBRATION: Calibration | None = None


def calibrate(calls: int = 400, rounds: int = 5) -> Calibration:
    """Measure the :class:`Calibration` (about 2 ms, once per process)."""
    global _CALIBRATION
    if _CALIBRATION is not None:
        return _CALIBRATION
    from kvmetrics.integrations.vllm.helper_hooks import eviction_counter

    pairs = []
    for _ in range(200):
        t0 = thread_time_ns()
        pairs.append(thread_time_ns() - t0)
    clock = float(statistics.median(pairs))
    direct = _loop_ns(_Base().step, calls, rounds)
    layer = _loop_ns(_Layer().step, calls, rounds) - direct
    wrapped = eviction_counter(_Base().step, _Tally(), lambda hook: None)
    evict = _loop_ns(wrapped, calls, rounds) - direct
    _CALIBRATION = Calibration(clock, max(layer, 0.0), max(evict, 0.0))
    return _CALIBRATION
