"""What the patch series of docs/vllm-patches/ costs on a step where nothing fails.

``update_from_output`` is the scheduler's hot path (its per-request loop runs for
every scheduled request of every step). On a step where no KV load failed, the
series adds, in 0003, two truthiness checks per step (``if self._sync_loads_in_flight
or self._aborted_during_sync_loads``; the 0.33.0 backport: ``if self._finished_in_flight``)
and nothing per request; 0001, 0002 and 0004 change only the failure and async-load
admission paths. This measures it: vLLM's own scheduler and the series applied up to
each of its patches, ``batch`` requests decoding with a KV connector configured
(lockstep, nothing fails), the time of ``update_from_output`` of the fastest of
``rounds`` x ``steps`` steps (the least disturbed by other load on a shared machine),
and ``schedule`` for comparison; the installed scheduler loaded as a copy, the way
the patched ones are, is the baseline.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Row


def _per_step(target: Any, batch: int, steps: int) -> tuple[float, float]:
    """The fastest step's (update_from_output, schedule) seconds, ``batch`` requests
    decoding (the minimum is the estimate least disturbed by other load on the machine)."""
    from kvmetrics.lab.vllm import canaries
    from kvmetrics.lab.vllm.compat import runner_output

    with canaries.on_target(target):
        b = canaries.bench("recompute", num_gpu_blocks=8 * batch + 64, max_model_len=2048,
                           max_num_batched_tokens=max(2048, 32 * batch),
                           scheduler_options={"max_num_seqs": batch})
    for i in range(batch):
        b.add(f"r{i}", canaries.prompt(1_000 + 64 * i, 32), max_tokens=steps + 8)
    while any(b.requests[f"r{i}"].num_output_tokens == 0 for i in range(batch)):
        b.step()
    update = schedule = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        out = b.sched.schedule()
        t1 = time.perf_counter()
        step = b.execute(out)
        output = runner_output(req_ids=step.req_ids, sampled_token_ids=step.sampled,
                               kv_connector_output=None)
        t2 = time.perf_counter()
        b.sched.update_from_output(out, output)
        update = min(update, time.perf_counter() - t2)
        schedule = min(schedule, t1 - t0)
    return update, schedule


def run(quick: bool = False) -> list[Row]:
    from kvmetrics.lab.vllm.canaries import VLLM, vllm_version
    from kvmetrics.lab.vllm.patched import installed_series, patched_target

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    batch, steps, rounds = (64, 20, 5) if quick else (256, 50, 7)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvmetrics-bench-series-") as scratch:
        patches = installed_series()
        # The installed scheduler, and the same file loaded the way the patched ones are
        # (a module of its own): the baseline the series is compared with.
        variants: list[tuple[str, Any]] = [
            (f"vLLM {vllm_version()}", VLLM),
            (f"vLLM {vllm_version()} as a copy", patched_target([], Path(scratch) / "copy"))]
        for count, patch in enumerate(patches, 1):
            variants.append((f"series up to {patch.stem}",
                             patched_target(patches[:count], Path(scratch) / patch.stem)))
        # Interleave the variants round by round, so that machine noise spreads evenly.
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in variants}
        for _ in range(rounds):
            for name, target in variants:
                samples[name].append(_per_step(target, batch, steps))
    case = f"{batch} requests decoding, nothing fails, fastest of {rounds}x{steps} steps"
    for name, _ in variants:
        update = min(u for u, _ in samples[name])
        schedule = min(s for _, s in samples[name])
        rows.append(Row("series hot path: update_from_output per step", f"{name}, {case}",
                        update * 1e6, "us"))
        rows.append(Row("series hot path: schedule per step", f"{name}, {case}",
                        schedule * 1e6, "us"))
    return rows
