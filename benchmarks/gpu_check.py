"""The data plane on a CUDA device: its load path, its verifier and its benchmark.

``scripts/gpu-check.sh`` runs each stage below in a process of its own under a time
limit, then :mod:`benchmarks.gpu_report` merges the parts into one JSON file. Every
stage builds the data plane exactly as the lab does (``resolve_device("cuda")``,
:class:`~kvmetrics.lab.kv.runner.TorchModelRunner`, :class:`~kvmetrics.lab.kv.copy.BlockCopier`),
so what passes here is the code kvmetrics ships, not a copy of it.

    python -m benchmarks.gpu_check preflight|load|verify|bench-load|bench-verify --part FILE

``--device cpu`` runs the same stages on the CPU: a dry run of this module on a
machine without a GPU (the script never passes it).

Exit status: 0 the stage passed, 1 a check failed (the part says which), 3 no CUDA
device or no torch (one line on stderr, no part written).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

NO_CUDA = 3
STAGES = ("preflight", "load", "verify", "bench-load", "bench-verify")


def cuda_or_refusal() -> str | None:
    """None when torch sees a CUDA device, else the one line that says why not."""
    try:
        import torch
    except ImportError as e:
        return f"gpu-check: torch is not importable with {sys.executable} ({e})"
    if not torch.cuda.is_available():
        built = "with" if torch.backends.cuda.is_built() else "without"
        return (f"gpu-check: no CUDA device visible (torch {torch.__version__} built {built} "
                f"CUDA); this check needs an NVIDIA GPU")
    return None


def stage_preflight(device: str = "cuda") -> dict[str, Any]:
    """The machine, and the data plane's own imports (numpy beside torch), so that a
    missing dependency shows up here rather than as every later stage's error."""
    import numpy
    import torch

    import kvmetrics.lab.kv  # noqa: F401

    if device != "cuda":
        return {"device_type": "cpu", "torch": torch.__version__, "device": "cpu",
                "numpy": numpy.__version__, "python": sys.version.split()[0]}
    props = torch.cuda.get_device_properties(0)
    return {"device_type": "cuda", "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "devices": torch.cuda.device_count(), "numpy": numpy.__version__,
            "python": sys.version.split()[0]}


#: A small cache and few running requests over six long prefixes: prefixes are
#: evicted and loaded back from the store many times (about 70 blocks a run).
EVICTING = dict(num_gpu_blocks=24, max_num_seqs=2)


def evicting_jobs(seed: int, abort_rate: float = 0.0) -> list[Any]:
    from kvmetrics.lab.kv.harness import shared_prefix_jobs

    return shared_prefix_jobs(seed, 32, spread=20, n_prefixes=6, prefix_len=32,
                              abort_rate=abort_rate)


def _copy_cases() -> Iterator[tuple[str, int, int, str]]:
    for dtype in ("float32", "float16", "bfloat16"):
        for block_size, kv_dim in ((16, 8), (16, 1024)):
            for layout in ("runs", "random"):
                yield dtype, block_size, kv_dim, layout


def stage_load(device_spec: str = "cuda") -> dict[str, Any]:
    """Batched host->device loads equal a per-block reference copy, and the engine's
    outputs and KV are bit-identical on CUDA and on the CPU."""
    import torch

    from benchmarks.bench_dataplane import load_layout
    from kvmetrics.lab.engine.faults import FaultPlan
    from kvmetrics.lab.kv.copy import BlockCopier
    from kvmetrics.lab.kv.device import resolve_device, resolve_dtype
    from kvmetrics.lab.kv.harness import build_engine, drive

    device = resolve_device(device_spec)
    on_gpu = device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    copies = []
    for dtype, block_size, kv_dim, layout in _copy_cases():
        slots, ids, space = load_layout(layout, 256, gen)
        store = torch.randn(space, block_size, kv_dim, generator=gen).to(
            resolve_dtype(dtype))
        if on_gpu:
            store = store.pin_memory()
        cache = torch.full((space, block_size, kv_dim), float("nan"),
                           dtype=store.dtype, device=device)
        BlockCopier(device).copy(cache, ids.to(device), store, slots)
        if on_gpu:
            torch.cuda.synchronize(device)
        expected = torch.stack([store[int(s)] for s in slots]).to(device)
        copies.append({"dtype": dtype, "block_bytes": block_size * kv_dim * store.element_size(),
                       "layout": layout, "equal": bool(torch.equal(cache[ids.to(device)],
                                                                   expected))})
    engines = []
    for config in (dict(policy="fail", load_mode="mixed"),
                   dict(policy="recompute", load_mode="async", async_delay_steps=2),
                   dict(policy="recompute", load_mode="sync", dtype="bfloat16")):
        runs = {}
        for dev in ("cpu", device_spec):
            engine = build_engine(faults=FaultPlan(rate=0.3, seed=3), seed=3, device=dev,
                                  **EVICTING, **config)
            runs[dev] = (engine, drive(engine, evicting_jobs(3, abort_rate=0.1)))
        gpu = runs[device_spec][0].runner
        engines.append({
            "config": ", ".join(f"{k}={v}" for k, v in config.items()),
            "on_device": gpu.cache.data.device.type == device.type,
            "store_pinned": gpu.host is not None and gpu.host.data.is_pinned(),
            "same_outputs": runs[device_spec][1] == runs["cpu"][1],
            "same_kv": gpu.kv_checksum() == runs["cpu"][0].runner.kv_checksum(),
            "same_findings": gpu.findings == runs["cpu"][0].runner.findings,
            "loaded_blocks": gpu.stats.loaded_blocks, "poisoned_blocks": gpu.stats.poisoned_blocks,
        })
    ok = (all(c["equal"] for c in copies)
          and all(e["on_device"] and e["store_pinned"] == on_gpu and e["same_outputs"]
                  and e["same_kv"] and e["same_findings"]
                  and e["loaded_blocks"] > 0 for e in engines))
    return {"ok": ok, "copies": copies, "engines": engines}


@contextmanager
def _skipped_rollback() -> Iterator[None]:
    """A broken recovery: requests keep their pre-step token count instead of being
    truncated to their first failed block, so they later read the failed block's KV."""
    import kvmetrics.lab.engine.update as update

    original = update.handle_invalid_blocks

    def broken(sched, invalid, num_scheduled, events):  # type: ignore[no-untyped-def]
        before = {r.request_id: r.num_computed_tokens - num_scheduled.get(r.request_id, 0)
                  for r in sched.running}
        affected = original(sched, invalid, num_scheduled, events)
        for r in sched.running:
            if r.request_id in affected:
                r.num_computed_tokens = before[r.request_id]
        return affected

    update.handle_invalid_blocks = broken
    try:
        yield
    finally:
        update.handle_invalid_blocks = original


def stage_verify(device: str = "cuda") -> dict[str, Any]:
    """On CUDA a correct recovery gives zero findings under full verification, and a
    broken one is caught naming the request that read the failed block."""
    import random

    from kvmetrics.lab.engine.faults import FaultPlan, ScriptedFailure
    from kvmetrics.lab.kv.harness import Job, build_engine, drive, populate_store

    clean = build_engine(policy="recompute", load_mode="sync", faults=FaultPlan(rate=0.3, seed=3),
                         seed=3, device=device, strict=True, **EVICTING)
    drive(clean, evicting_jobs(3))
    rng = random.Random(7)
    prefix = tuple(rng.randrange(50_000) for _ in range(16))
    broken = build_engine(policy="recompute", block_size=4, device=device,
                          faults=FaultPlan(scripted=(ScriptedFailure(1, "A"),)))
    populate_store(broken, prefix + tuple(rng.randrange(50_000) for _ in range(4)))
    with _skipped_rollback():
        drive(broken, [Job("A", prefix + tuple(rng.randrange(50_000) for _ in range(6)), 3)])
    stats = clean.runner.stats
    caught = broken.runner.findings
    result = {
        "clean": {"findings": stats.findings, "verified_tokens": stats.verified_tokens,
                  "loaded_blocks": stats.loaded_blocks, "poisoned_blocks": stats.poisoned_blocks,
                  "discarded_reads": stats.discarded_reads},
        "broken_rollback": {"findings": len(caught),
                            "first": str(caught[0]) if caught else None},
    }
    result["ok"] = (stats.findings == 0 and stats.verified_tokens > 0
                    and stats.poisoned_blocks > 0 and bool(caught)
                    and caught[0].request_id == "A" and caught[0].block_index == 1)
    return result


def stage_bench_load(device: str = "cuda", repeat: int = 7) -> dict[str, Any]:
    from benchmarks.bench_dataplane import TARGET_CASE, TARGET_RATIO, bench_loads
    from kvmetrics.lab.kv.device import resolve_device

    rows = bench_loads(resolve_device(device), repeat)
    return {"ok": True, "repeat": repeat, "target": {"ratio": TARGET_RATIO,
                                                      "block_bytes": TARGET_CASE[0],
                                                      "layout": TARGET_CASE[1]},
            "rows": rows}


def stage_bench_verify(device: str = "cuda", repeat: int = 4) -> dict[str, Any]:
    from benchmarks.bench_dataplane import bench_verification
    from kvmetrics.lab.kv.device import resolve_device

    return {"ok": True, "repeat": repeat,
            "rows": bench_verification(resolve_device(device), repeat)}


RUNNERS: dict[str, Callable[[str], dict[str, Any]]] = {
    "preflight": lambda device: {"ok": True, **stage_preflight(device)},
    "load": stage_load,
    "verify": stage_verify,
    "bench-load": stage_bench_load,
    "bench-verify": stage_bench_verify,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--part", type=Path, required=True, help="where this stage's JSON goes")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a dry run of these stages without a GPU")
    args = parser.parse_args(argv)
    refusal = cuda_or_refusal() if args.device == "cuda" else None
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return NO_CUDA
    start = time.perf_counter()
    try:
        result = RUNNERS[args.stage](args.device)
    except Exception as e:  # a failed stage is a figure too: say what broke, in one line
        result = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
    result["seconds"] = round(time.perf_counter() - start, 2)
    args.part.write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
