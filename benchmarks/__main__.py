"""Run every benchmark and print one table (``--quick`` for a short pass)."""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
import time

from benchmarks.common import Row, render

MODULES = ("bench_exporter", "bench_endpoint", "bench_reference", "bench_dataplane",
           "bench_vllm", "bench_lab", "bench_soak", "bench_serve", "bench_defect_patches",
           "bench_series_hot_path",
           "bench_multiprocess")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("--quick", action="store_true", help="fewer rounds, smaller sizes")
    parser.add_argument("--only", action="append", choices=MODULES, help="run just these")
    args = parser.parse_args()
    rows: list[Row] = []
    for name in args.only or MODULES:
        start = time.monotonic()
        module = importlib.import_module(f"benchmarks.{name}")
        rows.extend(module.run(quick=args.quick))
        print(f"{name}: {time.monotonic() - start:.1f} s", file=sys.stderr)
    print(f"# {platform.node()} {platform.machine()} python {platform.python_version()} "
          f"{time.strftime('%Y-%m-%d')}")
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
