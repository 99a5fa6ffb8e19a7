"""Soak throughput: ``kvmetrics soak --jobs 2`` against one process, same campaign.

Both sides run the same seeded scenarios (data-plane verifier on, as a default
soak runs), interleaved and alternating which goes first; the speed-up is the
ratio of the best wall times, and the two reports must be equal but for wall time
(the benchmark fails loudly otherwise). Worker start-up (spawned processes import
torch) is included: it is what a user pays.

    python -m benchmarks.bench_soak [--scenarios N] [--rounds R]
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from benchmarks.common import Row
from kvmetrics.lab.soak import soak

#: On two cores two workers should nearly halve the wall time.
TARGET_SPEEDUP = 1.6


def _timed(jobs: int, scenarios: int, seed: int) -> tuple[float, dict]:
    start = time.perf_counter()
    report = soak(scenarios, seed=seed, verify="full", jobs=jobs)
    wall = time.perf_counter() - start
    data = report.as_dict()
    data.pop("wall_seconds")
    return wall, data


def measure(scenarios: int, rounds: int, seed: int = 5000) -> dict[str, float]:
    logging.getLogger("kvmetrics").setLevel(logging.CRITICAL)
    best = {1: float("inf"), 2: float("inf")}
    walls: dict[int, list[float]] = {1: [], 2: []}
    reports: dict[int, dict] = {}
    for i in range(rounds):
        for jobs in ((1, 2) if i % 2 == 0 else (2, 1)):
            wall, data = _timed(jobs, scenarios, seed)
            walls[jobs].append(wall)
            best[jobs] = min(best[jobs], wall)
            if jobs in reports and reports[jobs] != data:
                raise AssertionError("a soak report changed between rounds")
            reports[jobs] = data
    if reports[1] != reports[2]:
        raise AssertionError("--jobs 2 gave a different report than --jobs 1")
    return {"scenarios": scenarios, "t1": best[1], "t2": best[2],
            "speedup": best[1] / best[2],
            "spread1": max(walls[1]) / best[1], "spread2": max(walls[2]) / best[2]}


def run(quick: bool = False) -> list[Row]:
    r = measure(24 if quick else 60, 2 if quick else 3)
    cpus = os.cpu_count() or 1
    return [
        Row("soak --jobs 2", f"{r['scenarios']} scenarios, verify full, 1 process",
            r["t1"], "s"),
        Row("soak --jobs 2", f"{r['scenarios']} scenarios, verify full, 2 processes",
            r["t2"], "s"),
        Row("soak --jobs 2", f"speed-up ({cpus} CPUs; slowest round +{r['spread2'] - 1:.0%})",
            r["speedup"], "x", f">= {TARGET_SPEEDUP}", r["speedup"] >= TARGET_SPEEDUP),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    r = measure(args.scenarios, args.rounds)
    print(f"{r['scenarios']} scenarios: 1 process {r['t1']:.2f} s, 2 processes {r['t2']:.2f} s,"
          f" speed-up {r['speedup']:.2f}x (slowest rounds +{r['spread1'] - 1:.0%} / "
          f"+{r['spread2'] - 1:.0%}); reports equal but for wall time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
