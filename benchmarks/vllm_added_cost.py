"""kvmetrics' added CPU cost per step on vLLM's scheduler, next to vLLM's own statistics.

Two separately built, identical vLLM schedulers differ by a few percent (memory layout,
call depth), more than the 1 % this has to resolve. So ONE scheduler instance is switched
between code paths step by step (``benchmarks.added_cost_worker``):

- ``vllm``: vLLM's own ``schedule()`` and ``update_from_output()`` called directly,
  kvmetrics' wrappers on the cache manager, block pool and connector taken off the
  instance, ``log_stats`` off;
- ``control``: ``vllm`` again under another name: its difference from ``vllm`` (an A/A
  comparison) shows what the method resolves on this machine at that moment;
- ``stats``: the same with ``log_stats`` on (vLLM's scheduler-side statistics);
- ``frame``: ``vllm`` called through one pass-through function per call, no kvmetrics
  work: what running vLLM's code one call deeper costs by itself;
- ``kvmetrics``: the instrumented class, wrappers on, ``log_stats`` off, recording into
  a pipeline with a Prometheus sink from inside ``update_from_output()`` (as under
  ``vllm serve``): everything kvmetrics adds.

The order is balanced: blocks of 25 steps in which every mode runs five times and
follows every mode (itself included) exactly once (a de Bruijn sequence of order 2),
relabelled at random each round, so what a step leaves to the next lands on every mode
alike and cancels from their differences. kvmetrics' clock runs as under ``vllm serve``
at ``--step-ms`` a decode step: its time-based gauge floor, and the pool audit that
comes with a gauge read, fall due by the server time of its own steps, not by the
simulator's. A recorded step (events, gauges, the pool audit, the CPU report) is
followed by one more ``kvmetrics`` step, timed as kvmetrics' own: under ``vllm serve``
the step after a recorded one is a kvmetrics step and pays what the recorded one left
behind (cold caches). Requests are replaced every ~900 steps, untimed: kvmetrics
records their events, but its gauge read and audit cannot fall due then (their schedule
is put back after), and one untimed ``vllm`` step takes what the refill leaves behind.

A step's cost is this thread's CPU time in ``schedule()`` plus ``update_from_output()``
(the model runner is untimed: the same in every mode). Each mode is compared with the
``vllm`` mode by plain means (recorded steps and interrupts included: ``vllm serve``
runs both) over 16 batches of consecutive blocks; a process's 95 % interval is t (15
degrees of freedom) on the batch differences. The balanced order takes what a quiet
step leaves to the next out of every difference; it is shown on its own (the mean step
after a quiet ``kvmetrics`` or a ``stats`` step less the mean step after a ``vllm``
one), since under ``vllm serve`` it comes on top. Each size runs in ``--processes``
separate processes one after another; the figure is their mean and its interval spans
every process's interval. A verdict is printed only with two processes or more, each
with an A/A control whose interval holds 0; otherwise "unresolved". The garbage
collector is off in the timed stretch (a collection lands on whichever step allocates
last). Prompt lengths are staggered over a block so block allocations spread evenly
over the steps.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.added_cost_design import BATCHES, Estimate, batch_estimate, combined, verdict
from benchmarks.added_cost_worker import MODES, RESULT

#: The decode step of a GPU server (a CPU server's is about 2 ms).
STEP_MS = 10.0
#: The share of vLLM's scheduler step kvmetrics may add at most (acceptance target).
SHARE_TARGET = 0.5
ROOT = Path(__file__).resolve().parents[1]


def run_process(running: int, cycles: int, step_ms: float, seed: int) -> dict[str, Any]:
    """One worker process at one size; its result, or a RuntimeError with its last line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", "benchmarks.added_cost_worker",
                           str(running), str(cycles), repr(step_ms), str(seed)],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    raise RuntimeError(f"the worker at {running} running exited {done.returncode}: {last}")


def _mean(results: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in results if not math.isnan(r[key])]
    return sum(values) / len(values) if values else math.nan


def size_rows(results: list[dict[str, Any]]) -> list[Any]:
    """The table rows of one size from its processes' results."""
    from benchmarks.common import Row

    first = results[0]
    n, processes = first["running"], len(results)
    case = (f"{n} running, {processes} x {first['cycles']} cycles of {len(MODES)} modes, "
            f"{first['step_ms']:g} ms steps")
    each = {name: [batch_estimate(r["diffs"][name]) for r in results]
            for name in first["diffs"]}
    est = {name: combined(per) for name, per in each.items()}
    control, added, minus = est["control"], est["added"], est["minus"]
    vllm_us = _mean(results, "vllm_us")
    kv_steps = sum(r["kv_steps"] for r in results)
    recorded = sum(r["recorded"] for r in results)

    def span(name: str) -> str:
        return ", ".join(f"{e.us:.2f}" for e in each[name])

    aa_ok = all(e.holds(0.0) for e in each["control"])
    state, below = verdict(minus, each["control"])
    share = Estimate(*(100 * x / vllm_us for x in (added.us, added.low, added.high)))
    share_state, share_ok = verdict(share, each["control"], SHARE_TARGET)
    reported = _mean(results, "reported_us")
    bias = Estimate(reported - added.us, reported - added.high, reported - added.low)
    bias_state, bias_ok = verdict(bias, each["control"])
    return [
        Row("vLLM scheduler CPU/step, stats off (mean)", case, vllm_us, "us"),
        Row("A/A control (vLLM - vLLM)", case, control.us,
            control.text() + f"; per process {span('control')}", "each CI holds 0", aa_ok),
        Row("vLLM's own stats (log_stats on - off)", case, est["stats"].us,
            est["stats"].text() + f"; per process {span('stats')}"),
        Row("one pass-through frame (no kvmetrics work)", case, est["frame"].us,
            est["frame"].text()),
        Row("kvmetrics added cost (recorded steps and the step after each in)", case,
            added.us, added.text() + f"; per process {span('added')}"),
        Row("kvmetrics added - vLLM's own stats", case, minus.us,
            minus.text() + f"; per process {span('minus')}", f"<= 0: {state}", below),
        Row("carry-over of a quiet kvmetrics step onto the next (not in added)", case,
            est["carry_kvmetrics"].us, est["carry_kvmetrics"].text()),
        Row("carry-over of a stats step onto the next (not in stats)", case,
            est["carry_stats"].us, est["carry_stats"].text()),
        Row("kvmetrics added cost share", case, share.us,
            share.text("% of vLLM's scheduler CPU"), f"<= {SHARE_TARGET:g} %: {share_state}",
            share_ok),
        Row("recorded kvmetrics steps", case, 100 * recorded / kv_steps,
            f"% of {kv_steps} kvmetrics steps" + (
                f" (one in {kv_steps / recorded:.0f}); each "
                f"{_mean(results, 'recorded_us'):.1f} us above the mean vLLM step, the "
                f"step after it {_mean(results, 'after_us'):.1f} us" if recorded else
                " (none: too few steps for the gauge cadence)")),
        Row("kvmetrics self-reported CPU", case, reported,
            f"us/step (quiet steps {_mean(results, 'sampled_us'):.2f} sampled, eviction "
            f"wrapper {_mean(results, 'evict_us'):.2f}, timed "
            f"{_mean(results, 'timed_us'):.2f})"),
        Row("self-reported - added (a lower bound: <= 0)", case, bias.us, bias.text(),
            f"<= 0: {bias_state}", bias_ok),
    ]


def rows(quick: bool = False, sizes: tuple[int, ...] = (16, 64, 256),
         cycles: int | None = None, step_ms: float = STEP_MS,
         processes: int = 2) -> list[Any]:
    from benchmarks.common import Row

    if cycles is None:
        cycles = 320 if quick else 3200
    out: list[Row] = []
    for n in sizes:
        load_before = os.getloadavg()[0]
        results = [run_process(n, cycles, step_ms, seed=1000 * n + p)
                   for p in range(processes)]
        # Other processes on the machine widen every interval: say how busy it was.
        out.append(Row("load average (1 min), before / after", f"{n} running", load_before,
                       f"/ {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"))
        out += size_rows(results)
    return out


def _options(argv: list[str] | None = None) -> Any:
    import argparse

    class OneLine(argparse.ArgumentParser):
        def error(self, message: str) -> Any:  # one line, no usage block
            self.exit(2, f"{self.prog}: error: {message}\n")

    parser = OneLine(prog="python -m benchmarks.vllm_added_cost",
                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="320 cycles a size")
    parser.add_argument("--sizes", default="16,64,256",
                        help="running requests, comma-separated (default: 16,64,256)")
    parser.add_argument("--cycles", type=int, default=None,
                        help="steps of each mode a process (default 3,200; rounded up to "
                             f"whole blocks of {len(MODES)})")
    parser.add_argument("--step-ms", type=float, default=STEP_MS,
                        help="the decode step of the server whose gauge cadence kvmetrics "
                             f"keeps, in ms (default {STEP_MS:g}: a GPU server; 2: a CPU one)")
    parser.add_argument("--processes", type=int, default=2,
                        help="separate processes per size, one after another (default 2)")
    options = parser.parse_args(argv)
    try:
        options.sizes = tuple(int(x) for x in options.sizes.split(","))
        if not options.sizes or min(options.sizes) < 1 or max(options.sizes) > 1024:
            raise ValueError
    except ValueError:
        parser.error(f"--sizes: comma-separated counts of 1 to 1024, not {options.sizes!r}")
    least = BATCHES * len(MODES)
    if options.cycles is not None and not least <= options.cycles <= 10**6:
        parser.error(f"--cycles: {least} to 1,000,000 ({BATCHES} batches of at least one "
                     f"block of {len(MODES)} cycles)")
    if not (math.isfinite(options.step_ms) and 0.05 <= options.step_ms <= 10_000):
        parser.error(f"--step-ms: a decode step of 0.05 to 10,000 ms, not {options.step_ms:g}")
    if not 1 <= options.processes <= 64:
        parser.error(f"--processes: 1 to 64, not {options.processes}")
    return options


if __name__ == "__main__":
    from benchmarks.common import render

    opts = _options()
    try:
        table = rows(opts.quick, opts.sizes, opts.cycles, opts.step_ms, opts.processes)
    except RuntimeError as error:
        print(f"vllm_added_cost: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    print(render(table))
