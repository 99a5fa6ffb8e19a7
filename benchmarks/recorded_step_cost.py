"""What one recorded step costs the instrumented vLLM scheduler, by number of decodes.

A recorded step is the end of a step that kvmetrics hands to its pipeline: a step where
something happened, or a periodic gauge read (vLLM's gauges, the self-checks, now and
then the pool audit and the CPU counter's report, the exporters). This runs the real
vLLM scheduler at steady decode with kvmetrics' clock advanced by ``--step-ms`` per
step, as under ``vllm serve`` (a gauge read every 32nd step at 10 ms), and prints the
thread CPU time of the recorded part (``StepEnd._kv_end_step_timed``) per size, and
of the gauge read with its self-checks inside it (vLLM's accessors, kvmetrics' own
count of vLLM's queues and its comparisons with vLLM's figures, one function)
separately. The event cross-checks (an admission's prompt split, a
finish's preemptions) run in the hooks, once per event: their calls and mean cost are
printed per size too. Each self-check call is timed by a wrapper whose clock read is
calibrated and taken off, so the figures are the checks' own cost.

    python -m benchmarks.recorded_step_cost 16 64 --steps 1450
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
from dataclasses import dataclass, field
from time import monotonic_ns, thread_time_ns
from typing import Any

#: The self-check entry points timed (methods of SelfChecks): the gauge read, whose
#: own count of vLLM's queues and comparisons with vLLM's figures are inline with the
#: reads of vLLM's accessors, and the comparisons the event hooks make. A call made
#: inside another timed one is not timed twice.
_CHECK_METHODS = ("gauges", "compare", "prefill", "finished_preemptions")


def clock_read_ns(rounds: int = 2000) -> float:
    """The least interval between two thread-clock reads: what a timing wrapper adds."""
    return float(min(-thread_time_ns() + thread_time_ns() for _ in range(rounds)))


class CheckTimer:
    """Times the self-checks (outermost call only), less the clock reads."""

    def __init__(self, clock_ns: float) -> None:
        self.clock_ns = clock_ns
        self.ns = 0.0
        self.calls = 0
        self.depth = 0

    def wrap(self, function: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return function(*args, **kwargs)
            self.depth = 1
            start = thread_time_ns()
            try:
                return function(*args, **kwargs)
            finally:
                self.ns += max(0.0, thread_time_ns() - start - self.clock_ns)
                self.calls += 1
                self.depth = 0
        return timed


@dataclass
class Costs:
    """One run: per recorded step, its cost and its self-checks' (ns); the event
    cross-checks outside recorded steps (calls, total ns)."""

    recorded: list[int] = field(default_factory=list)
    checks: list[float] = field(default_factory=list)
    event_calls: int = 0
    event_ns: float = 0.0


def measure(running: int, steps: int, step_ms: float) -> Costs:
    """The recorded part's thread CPU time (ns) of each recorded step of one run."""
    from benchmarks.bench_vllm import _vllm_engine
    from kvmetrics.exporters.prometheus import PrometheusSink
    from kvmetrics.metrics.pipeline import MetricsPipeline
    from kvmetrics.vllm import selfcheck, step_end

    engine = _vllm_engine(running, True)
    sched = engine.scheduler
    sched.kvmetrics_pipeline = MetricsPipeline([PrometheusSink()], engine_kind="vllm")
    cls = type(sched)
    recorded = cls._kv_end_step_timed
    own = "_kv_end_step_timed" in cls.__dict__  # else inherited: removed again after
    costs = Costs()
    checks = CheckTimer(clock_read_ns())
    originals: list[tuple[Any, str, Any]] = [
        (selfcheck.SelfChecks, name, getattr(selfcheck.SelfChecks, name))
        for name in _CHECK_METHODS]

    def timed(self: Any, *args: Any) -> None:
        before_ns, before_calls = checks.ns, checks.calls
        costs.event_ns, costs.event_calls = (costs.event_ns + before_ns,
                                             costs.event_calls + before_calls)
        checks.ns, checks.calls = 0.0, 0
        start = thread_time_ns()
        try:
            recorded(self, *args)
        finally:
            costs.recorded.append(thread_time_ns() - start)
            costs.checks.append(checks.ns)
            checks.ns, checks.calls = 0.0, 0

    now = [monotonic_ns()]
    real_clock = step_end.monotonic_ns
    cls._kv_end_step_timed = timed  # type: ignore[method-assign]
    for owner, name, function in originals:
        setattr(owner, name, checks.wrap(function))
    step_end.monotonic_ns = lambda: now[0]
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        for _ in range(steps):
            now[0] += round(step_ms * 1e6)
            engine.step()
    finally:
        if own:
            cls._kv_end_step_timed = recorded  # type: ignore[method-assign]
        else:
            del cls._kv_end_step_timed
        step_end.monotonic_ns = real_clock
        for owner, name, function in originals:
            setattr(owner, name, function)
        if gc_was_on:
            gc.enable()
    engine.close()
    costs.event_ns += checks.ns
    costs.event_calls += checks.calls
    return costs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recorded_step_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("running", nargs="*", type=int, default=[16, 64, 256],
                        help="running decodes (default: 16 64 256)")
    parser.add_argument("--steps", type=int, default=1450,
                        help="steps per size (under 1500: the requests' length)")
    parser.add_argument("--step-ms", type=float, default=10.0,
                        help="kvmetrics' clock per step, as a server's decode step")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.running) or not 0 < args.steps < 1500 or args.step_ms <= 0:
        parser.error("sizes must be positive, --steps in 1..1499, --step-ms positive")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    print("running  recorded  mean_us  median_us  q1_us  q3_us  checks_mean_us  "
          "checks_median_us  event_checks  event_check_mean_us")
    for n in args.running:
        run = measure(n, args.steps, args.step_ms)
        costs = run.recorded
        if len(costs) < 2:
            print(f"{n:7d}  {len(costs):8d}  (too few recorded steps: raise --steps)")
            continue
        q1, _, q3 = statistics.quantiles(costs)
        event_mean = run.event_ns / run.event_calls / 1e3 if run.event_calls else 0.0
        print(f"{n:7d}  {len(costs):8d}  {statistics.fmean(costs) / 1e3:7.1f}  "
              f"{statistics.median(costs) / 1e3:9.1f}  {q1 / 1e3:5.1f}  {q3 / 1e3:5.1f}  "
              f"{statistics.fmean(run.checks) / 1e3:14.2f}  "
              f"{statistics.median(run.checks) / 1e3:16.2f}  {run.event_calls:12d}  "
              f"{event_mean:19.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
