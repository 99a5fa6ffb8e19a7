"""What one recorded step costs the instrumented vLLM scheduler, by number of decodes.

A recorded step is the end of a step that kvmetrics hands to its pipeline: a step where
something happened, or a periodic gauge read (vLLM's gauges, the self-checks, now and
then the pool audit and the CPU counter's report, the exporters). This runs the real
vLLM scheduler at steady decode with kvmetrics' clock advanced by ``--step-ms`` per
step, as under ``vllm serve`` (a gauge read every 32nd step at 10 ms), and prints the
thread CPU time of the recorded part (``StepEnd._kv_end_step_timed``) per size.

    python -m benchmarks.recorded_step_cost 16 64 --steps 1450
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
from time import monotonic_ns, thread_time_ns
from typing import Any


def measure(running: int, steps: int, step_ms: float) -> list[int]:
    """The recorded part's thread CPU time (ns) of each recorded step of one run."""
    from benchmarks.bench_vllm import _vllm_engine
    from kvmetrics.exporters.prometheus import PrometheusSink
    from kvmetrics.integrations.vllm import step_end
    from kvmetrics.metrics.pipeline import MetricsPipeline

    engine = _vllm_engine(running, True)
    sched = engine.scheduler
    sched.kvmetrics_pipeline = MetricsPipeline([PrometheusSink()], engine_kind="vllm")
    cls = type(sched)
    recorded = cls._kv_end_step_timed
    own = "_kv_end_step_timed" in cls.__dict__  # else inherited: removed again after
    costs: list[int] = []

    def timed(self: Any, *args: Any) -> None:
        start = thread_time_ns()
        try:
            recorded(self, *args)
        finally:
            costs.append(thread_time_ns() - start)

    now = [monotonic_ns()]
    real_clock = step_end.monotonic_ns
    cls._kv_end_step_timed = timed  # type: ignore[method-assign]
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
        if gc_was_on:
            gc.enable()
    engine.close()
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
    print("running  recorded  mean_us  median_us  q1_us  q3_us")
    for n in args.running:
        costs = measure(n, args.steps, args.step_ms)
        if len(costs) < 2:
            print(f"{n:7d}  {len(costs):8d}  (too few recorded steps: raise --steps)")
            continue
        q1, _, q3 = statistics.quantiles(costs)
        print(f"{n:7d}  {len(costs):8d}  {statistics.fmean(costs) / 1e3:7.1f}  "
              f"{statistics.median(costs) / 1e3:9.1f}  {q1 / 1e3:5.1f}  {q3 / 1e3:5.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
