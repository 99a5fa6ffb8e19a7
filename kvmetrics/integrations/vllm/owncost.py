"""kvmetrics' own CPU time on vLLM's scheduler thread, estimated without a clock per step.

``kvmetrics_instrumentation_cpu_seconds_total`` estimates the CPU time the instrumented
scheduler adds to vLLM's. It has two parts:

1. **Timed, every time: the work that varies.** The end of a recorded step (events,
   gauge reads, self-checks, exporters, the pool audit: every 32nd step and every step
   where something happened) and the hooks on vLLM's rarer paths (admission, loads,
   preemption, finish, recovery) read the thread CPU clock around themselves on every
   call. A pair of reads sees about one read's cost, so each interval is counted with
   one more read (:attr:`Calibration.clock_ns`): the clock reads are kvmetrics' cost too.
2. **Calibrated: the work that does not vary.** On a step where nothing happened the
   two overrides vLLM calls (``schedule``, ``update_from_output``) do the same few
   attribute tests and integer updates every time, and the block pool's eviction counter
   one increment per evicted block. Timing those would cost more than they do (a clock
   read is a system call, 0.6-0.9 us on the VMs measured, against a few tenths of a
   microsecond of work), and an interval that short is mostly the clock read's own
   cost, which varies with the state of the caches around it: a sampled timing of them
   was measured several times too high. So at construction (once per process, about
   3 ms) the real override functions run in a tight loop on a probe instance over a
   stand-in for vLLM's class, against the stand-in called directly: the difference is
   the quiet step's cost (:attr:`Calibration.step_ns`), charged once per step; the real
   eviction wrapper is calibrated the same way and charged per evicted block.

What it cannot see: the calibrated figures are warm-cache figures; the same code in a
real step, between two of vLLM's calls, misses the caches more. And kvmetrics' code and
data take vLLM's place in the CPU caches between calls, which shows in vLLM's time, not
kvmetrics'. ``benchmarks/vllm_added_cost.py`` measures the whole added cost and compares.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from time import thread_time_ns
from typing import Any


@dataclass(frozen=True)
class Calibration:
    """Warm-cache costs in nanoseconds, measured once per process."""

    #: What one ``thread_time_ns()`` adds to an interval it bounds (a read's full cost
    #: is about this much: part before the clock is sampled, part after).
    clock_ns: float = 0.0
    #: The two overrides on a step where nothing happened, beyond vLLM's own calls.
    step_ns: float = 0.0
    #: The block pool's eviction wrapper per evicted block (its layer and the tally).
    evict_ns: float = 0.0


class _StandIn:
    """Stands in for vLLM's scheduler class under the probe: returns at once."""

    def schedule(self) -> None:
        return None

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> None:
        return None


class _Tally:
    evicted_n = 0


def _least_ns(loop: Any, calls: int, rounds: int) -> float:
    """The least thread CPU time per call of ``loop(calls)`` over ``rounds`` runs (the
    least is the run the rest of the machine disturbed least)."""
    best = math.inf
    for _ in range(rounds):
        t0 = thread_time_ns()
        loop(calls)
        best = min(best, thread_time_ns() - t0)
    return best / calls


def _probe(mixin: type) -> Any:
    """An instance of ``mixin`` over :class:`_StandIn` in the state of a quiet step."""
    from kvmetrics.integrations.vllm.recorder import StepRecorder

    cls = type("_Probe", (mixin, _StandIn), {})
    probe = object.__new__(cls)  # no vLLM, no exporter: only what the quiet step reads
    probe._kv = StepRecorder(16, "recompute", False)
    probe._kv_output_off = False
    probe._kv_step = 1
    probe._kv_read_next_ns = 1 << 62  # gauges never due: every 32nd step only looks
    probe._kv_errors = {}
    probe.kvmetrics_pipeline = object()
    return probe


_CALIBRATION: Calibration | None = None


def calibrate(mixin: type, calls: int = 300, rounds: int = 7) -> Calibration:
    """Measure the :class:`Calibration` with ``mixin``'s own overrides (once per process)."""
    global _CALIBRATION
    if _CALIBRATION is not None:
        return _CALIBRATION
    from kvmetrics.integrations.vllm.helper_hooks import eviction_counter

    pairs = []
    for _ in range(200):
        t0 = thread_time_ns()
        pairs.append(thread_time_ns() - t0)
    probe = _probe(mixin)
    schedule, update = probe.schedule, probe.update_from_output
    base_schedule, base_update = _StandIn.schedule, _StandIn.update_from_output

    def instrumented(n: int) -> None:
        for _ in range(n):
            schedule()
            update(None, None)

    def bare(n: int) -> None:
        for _ in range(n):
            base_schedule(probe)
            base_update(probe, None, None)

    def evicted(block: Any) -> bool:  # vLLM's _maybe_evict_cached_block, evicting
        return True

    wrapped = eviction_counter(evicted, _Tally(), lambda hook: None)

    def evicting(n: int) -> None:
        for _ in range(n):
            wrapped(None)

    def direct(n: int) -> None:
        for _ in range(n):
            evicted(None)

    step = _least_ns(instrumented, calls, rounds) - _least_ns(bare, calls, rounds)
    evict = _least_ns(evicting, calls, rounds) - _least_ns(direct, calls, rounds)
    _CALIBRATION = Calibration(float(statistics.median(pairs)), max(step, 0.0),
                               max(evict, 0.0))
    return _CALIBRATION
