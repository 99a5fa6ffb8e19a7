"""Benchmark of the KV data plane: batched block loads and the verifier's cost.

1. **Load bandwidth.** The data plane's batched store->cache load
   (:class:`kvmetrics.lab.kv.copy.BlockCopier`) against a plain contiguous ``copy_``
   of the same number of bytes from the same host tensor into the same cache,
   measured in the same run, interleaved, best of ``--repeat`` each (the least
   disturbed by other work on the machine), as a ratio (target >= 0.8 for 64 KiB
   blocks in the realistic layout). Two layouts: ``runs`` (realistic: each
   request's prefix is a run of 4-32 blocks adjacent in the store, as it was saved,
   and adjacent in the cache, as it was allocated; the runs in random order with
   gaps, independently on the two sides) and ``random``
   (every block at a random slot and a random block id: the worst case). The
   naive ``cache[ids] = store[slots]`` is shown for reference.
2. **Verification cost.** The same workload through the reference engine with
   the torch runner, verification ``full`` and ``sampled`` against ``off`` (the
   schedule is identical), as runner time per verified token.

    python -m benchmarks.bench_dataplane [--device auto|cpu|cuda] [--repeat N]
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable

import torch

from benchmarks.common import Row
from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.kv.copy import BlockCopier
from kvmetrics.lab.kv.device import resolve_device
from kvmetrics.lab.kv.harness import build_engine, drive, shared_prefix_jobs

TARGET_RATIO = 0.8
#: The block size (bytes) and layout the target applies to.
TARGET_CASE = (64 * 1024, "runs")
#: (block_size, kv_dim, blocks per load): bytes per block from the lab's default
#: (16 x 8 floats, 512 B) up to a realistic per-layer K+V block (64 KiB).
LOAD_SHAPES = ((16, 8, 8192), (16, 128, 1024), (16, 1024, 256))
LAYOUTS = ("runs", "random")


def _run_lengths(n: int, gen: torch.Generator) -> list[int]:
    lengths: list[int] = []
    while sum(lengths) < n:
        lengths.append(int(torch.randint(4, 33, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - n
    return lengths


def _place(lengths: list[int], gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """The runs laid out in random order with gaps of 0-8; (ids in run order, space)."""
    starts = {}
    pos = 0
    for k in torch.randperm(len(lengths), generator=gen).tolist():
        pos += int(torch.randint(0, 9, (1,), generator=gen))
        starts[k] = pos
        pos += lengths[k]
    return torch.cat([torch.arange(starts[k], starts[k] + length)
                      for k, length in enumerate(lengths)]), pos


def load_layout(kind: str, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(store slots, cache block ids >= 1, size of the space) for one load of ``n`` blocks.

    ``runs``: a load of several requests' prefixes, each saved to consecutive store
    slots and allocated consecutive blocks (4-32 of them), at unrelated places on
    the two sides. ``random``: every block anywhere."""
    if kind == "random":
        return (torch.randperm(2 * n, generator=gen)[:n],
                torch.randperm(2 * n, generator=gen)[:n] + 1, 2 * n + 1)
    lengths = _run_lengths(n, gen)
    slots, a = _place(lengths, gen)
    ids, b = _place(lengths, gen)
    return slots, ids + 1, max(a, b) + 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], object]) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def bench_loads(device: torch.device, repeat: int,
                threads: int | None = None) -> list[dict[str, float]]:
    """``threads``: torch intra-op threads for the measurement (None: torch's default)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _bench_loads(device, repeat)
    finally:
        torch.set_num_threads(before)


def _bench_loads(device: torch.device, repeat: int) -> list[dict[str, float]]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for (block_size, kv_dim, n), layout in itertools.product(LOAD_SHAPES, LAYOUTS):
        slots, ids, space = load_layout(layout, n, gen)
        store = torch.randn(space, block_size, kv_dim, generator=gen)
        if device.type == "cuda":
            store = store.pin_memory()
        cache = torch.zeros(space, block_size, kv_dim, device=device)
        ids = ids.to(device)
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
        expected = store[slots].to(device)
        cache.zero_()
        copier.copy(cache, ids, store, slots)
        assert torch.equal(cache[ids], expected), "the batched load copied the wrong blocks"
        rows.append({
            "layout": layout,
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
    repeat = 3 if quick else 15
    rows = []
    # One intra-op thread and torch's default: on a small shared machine a multi-threaded
    # memcpy mostly measures scheduling jitter, one thread the copy path itself.
    for threads in (1, None):
        label = "1 thread" if threads == 1 else f"{torch.get_num_threads()} threads"
        for r in bench_loads(device, repeat, threads):
            targeted = (r["block_bytes"], r["layout"]) == TARGET_CASE
            rows.append(Row(f"batched load ({device.type}, {label})",
                            f"{r['layout']}: {int(r['block_bytes'])} B blocks x "
                            f"{int(r['blocks'])}", r["ratio"], "x of contiguous copy",
                            f">= {TARGET_RATIO}" if targeted else "",
                            r["ratio"] >= TARGET_RATIO if targeted else None))
    for r in bench_verification(device, max(1, (repeat + 1) // 2)):
        if r["mode"] != "off":
            rows.append(Row(f"verification cost ({device.type})", r["mode"],
                            r["ns_per_token"], "ns/verified token"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto (default), cpu or cuda")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--repeat", type=int, default=7,
                        help="timed repetitions; the best one counts (least disturbed)")
    args = parser.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        parser.error(str(e))
    repeat = max(1, args.repeat)
    print(f"device {device}, torch {torch.__version__}, "
          f"threads {args.threads or torch.get_num_threads()}, "
          f"repeat {repeat}\n")

    print("batched store->cache load vs contiguous copy_ of the same bytes")
    print(f"{'layout':>7} {'block':>7} {'blocks':>6} {'MiB':>6} {'batched':>9} {'contig':>9} "
          f"{'naive':>9} {'ratio':>6}  (GB/s)")
    for r in bench_loads(device, repeat, args.threads):
        mark = ""
        if (r["block_bytes"], r["layout"]) == TARGET_CASE:
            mark = "  meets the target" if r["ratio"] >= TARGET_RATIO else "  BELOW the target"
        print(f"{r['layout']:>7} {r['block_bytes']:>6}B {r['blocks']:>6} {r['mbytes']:>6.1f} "
              f"{r['batched_gbs']:>9.2f} {r['contiguous_gbs']:>9.2f} {r['naive_gbs']:>9.2f} "
              f"{r['ratio']:>6.2f}{mark}")
    print(f"target: >= {TARGET_RATIO} for {TARGET_CASE[0]} B blocks, layout {TARGET_CASE[1]}\n")

    print("verification cost (runner time, same schedule in every mode)")
    print(f"{'mode':>8} {'runner s':>9} {'verified tok':>13} {'ns/verified tok':>16}")
    for r in bench_verification(device, max(1, (repeat + 1) // 2)):
        print(f"{r['mode']:>8} {r['runner_s']:>9.3f} {r['verified_tokens']:>13} "
              f"{r['ns_per_token']:>16.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
