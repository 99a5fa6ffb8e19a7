"""Benchmark of the KV data plane: batched block loads and the verifier's cost.

1. **Load bandwidth.** The data plane's batched store->cache load
   (:class:`kvmetrics.kv.copy.BlockCopier`: random slots into random block ids,
   index tensors, no loop over blocks) against a plain contiguous ``copy_`` of
   the same number of bytes from the same host tensor into the same cache,
   measured in the same run, interleaved, best of ``--repeat`` each (the least
   disturbed by other work on the machine), as a ratio (target >= 0.8). The naive
   ``cache[ids] = store[slots]`` is shown for reference.
2. **Verification cost.** The same workload through the reference engine with
   the torch runner, verification ``full`` and ``sampled`` against ``off`` (the
   schedule is identical), as runner time per verified token.

    python -m benchmarks.bench_dataplane [--device auto|cpu|cuda] [--repeat N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from benchmarks.common import Row
from kvmetrics.engine.faults import FaultPlan
from kvmetrics.kv.copy import BlockCopier
from kvmetrics.kv.device import resolve_device
from kvmetrics.kv.harness import build_engine, drive, shared_prefix_jobs

TARGET_RATIO = 0.8
#: (block_size, kv_dim, blocks per load): bytes per block from the lab's default
#: (16 x 8 floats, 512 B) up to a realistic per-layer K+V block (64 KiB).
LOAD_SHAPES = ((16, 8, 8192), (16, 128, 1024), (16, 1024, 256))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], object]) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def bench_loads(device: torch.device, repeat: int) -> list[dict[str, float]]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for block_size, kv_dim, n in LOAD_SHAPES:
        store = torch.randn(2 * n, block_size, kv_dim, generator=gen)
        if device.type == "cuda":
            store = store.pin_memory()
        cache = torch.zeros(2 * n + 1, block_size, kv_dim, device=device)
        slots = torch.randperm(2 * n, generator=gen)[:n]
        ids = (torch.randperm(2 * n, generator=gen)[:n] + 1).to(device)
        copier = BlockCopier(device)
        cases: dict[str, Callable[[], object]] = {
            "batched": lambda c=copier, d=cache, i=ids, s=store, sl=slots: c.copy(d, i, s, sl),
            "contiguous": lambda d=cache, s=store, n=n: d[:n].copy_(s[:n], non_blocking=True),
            "naive": lambda d=cache, s=store, i=ids, sl=slots: d.__setitem__(
                i, s[sl].to(device, non_blocking=True)),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(2):  # warm-up
            for fn in cases.values():
                _timed(device, fn)
        for _ in range(repeat):  # interleaved, so drift hits every case alike
            for name, fn in cases.items():
                times[name].append(_timed(device, fn))
        nbytes = n * block_size * kv_dim * 4
        best = {name: min(ts) for name, ts in times.items()}
        rows.append({
            "block_bytes": block_size * kv_dim * 4, "blocks": n, "mbytes": nbytes / 2**20,
            **{f"{name}_gbs": nbytes / t / 1e9 for name, t in best.items()},
            "ratio": best["contiguous"] / best["batched"],
        })
    return rows


def bench_verification(device: torch.device, repeat: int) -> list[dict[str, float]]:
    jobs = shared_prefix_jobs(7, 96, n_prefixes=4, prefix_len=48, suffix_len=(8, 48),
                              max_tokens=(4, 24), spread=40)
    config = dict(block_size=16, num_gpu_blocks=96, max_num_batched_tokens=256,
                  max_num_seqs=16, policy="recompute", load_mode="sync",
                  faults=FaultPlan(rate=0.05, seed=7), store_blocks=512, device=device)
    results: dict[str, list[float]] = {"off": [], "sampled": [], "full": []}
    verified: dict[str, int] = {}
    for _ in range(repeat):
        for mode in results:
            engine = build_engine(verify=mode, verify_fraction=0.25, **config)
            runner = engine.runner
            spent = [0.0]
            execute = runner.execute

            def timed_execute(out, execute=execute, spent=spent):
                _sync(device)
                start = time.perf_counter()
                result = execute(out)
                _sync(device)
                spent[0] += time.perf_counter() - start
                return result

            runner.execute = timed_execute
            drive(engine, jobs)
            results[mode].append(spent[0])
            verified[mode] = runner.stats.verified_tokens
            assert runner.findings == [], runner.findings[:3]
    base = min(results["off"])
    rows = []
    for mode, ts in results.items():
        t = min(ts)
        tokens = verified[mode]
        rows.append({"mode": mode, "runner_s": t, "verified_tokens": tokens,
                     "ns_per_token": (t - base) / tokens * 1e9 if tokens else 0.0})
    return rows


def run(quick: bool = False, device_spec: str = "auto") -> list[Row]:
    """The same measurements as rows of ``python -m benchmarks``' table."""
    device = resolve_device(device_spec)
    repeat = 3 if quick else 7
    rows = []
    for r in bench_loads(device, repeat):
        rows.append(Row(f"batched load ({device.type})",
                        f"{int(r['block_bytes'])} B blocks x {int(r['blocks'])}",
                        r["ratio"], "x of contiguous copy", f">= {TARGET_RATIO}",
                        r["ratio"] >= TARGET_RATIO))
    for r in bench_verification(device, max(1, (repeat + 1) // 2)):
        if r["mode"] != "off":
            rows.append(Row(f"verification cost ({device.type})", r["mode"],
                            r["ns_per_token"], "ns/verified token"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (default), cpu or cuda")
    parser.add_argument("--repeat", type=int, default=7,
                        help="timed repetitions; the best one counts (least disturbed)")
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        parser.error(str(e))
    repeat = max(1, args.repeat)
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"repeat {repeat}\n")

    print("batched store->cache load vs contiguous copy_ of the same bytes")
    print(f"{'block':>7} {'blocks':>6} {'MiB':>6} {'batched':>9} {'contig':>9} {'naive':>9} "
          f"{'ratio':>6}  (GB/s)")
    worst = float("inf")
    for r in bench_loads(device, repeat):
        worst = min(worst, r["ratio"])
        print(f"{r['block_bytes']:>6}B {r['blocks']:>6} {r['mbytes']:>6.1f} "
              f"{r['batched_gbs']:>9.2f} {r['contiguous_gbs']:>9.2f} {r['naive_gbs']:>9.2f} "
              f"{r['ratio']:>6.2f}")
    verdict = "meets" if worst >= TARGET_RATIO else "BELOW"
    print(f"worst ratio {worst:.2f}: {verdict} the {TARGET_RATIO} target\n")

    print("verification cost (runner time, same schedule in every mode)")
    print(f"{'mode':>8} {'runner s':>9} {'verified tok':>13} {'ns/verified tok':>16}")
    for r in bench_verification(device, max(1, (repeat + 1) // 2)):
        print(f"{r['mode']:>8} {r['runner_s']:>9.3f} {r['verified_tokens']:>13} "
              f"{r['ns_per_token']:>16.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
