"""What the fixes of docs/vllm-defects.md cost, on a shared-prefix workload.

A fix that evicts failed blocks, or rolls sharers back, trades reuse for
correctness: tokens recomputed twice (owner and sharers rewrite a shared block in
the same steps), and prefix hits that later requests no longer get. Both are
counts, not times, so one deterministic run per variant measures them exactly:
vLLM's own scheduler (the baseline, which reuses the failed KV), the patch series
of docs/vllm-patches/ applied to a copy of it up to each of its patches (the last
is the whole series), and kvmetrics' protective mode. The forward pass is not
run: cost here is tokens scheduled and tokens hit, which is what a forward pass
would spend.

Workload (lockstep, policy ``recompute``, blocks of 16): a 512-token system prompt
shared by every request, 64 tokens of its own each. Wave 1: ``owner`` loads the
system prompt through a sync connector load whose block #4 fails, and
``sharers`` requests are admitted in the same step (local hits on the owner's
fresh blocks). Wave 2, after wave 1 finished: ``later`` requests with the same
system prompt; the connector offers nothing to them (a store that has not
caught up), so what the prefix cache gives them is all the reuse there is.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import Row

PREFIX, OWN, FAILED_BLOCK = 512, 64, 4


def _workload(target: Any, sharers: int, later: int) -> tuple[int, int]:
    """(tokens scheduled in all, local-hit tokens of wave 2) on ``target``."""
    from kvmetrics.lab.vllm import canaries

    with canaries.on_target(target):
        b = canaries.bench("recompute", num_gpu_blocks=1024, max_model_len=2048,
                           max_num_batched_tokens=2048)
    system = canaries.prompt(1_000, PREFIX)
    b.add("owner", system + canaries.prompt(50_000, OWN), offer=PREFIX)
    for i in range(sharers):
        b.add(f"s{i}", system + canaries.prompt(60_000 + 100 * i, OWN))
    scheduled = 0
    out = b.sched.schedule()
    scheduled += sum(out.num_scheduled_tokens.values())
    failed = b.blocks("owner")[FAILED_BLOCK]
    b.update(b.execute(out), invalid={failed})
    while b.sched.running or b.sched.waiting:
        scheduled += sum(b.step().num_scheduled_tokens.values())
    hits = 0
    for i in range(later):
        b.add(f"l{i}", system + canaries.prompt(70_000 + 100 * i, OWN))
        out = b.sched.schedule()
        hits += canaries._hit(b, out, f"l{i}")[0]
        scheduled += sum(out.num_scheduled_tokens.values())
        b.update(b.execute(out))
        while b.sched.running:
            scheduled += sum(b.step().num_scheduled_tokens.values())
    return scheduled, hits


def _variants(scratch: Path) -> list[tuple[str, Any]]:
    from kvmetrics.lab.vllm.canaries import VLLM
    from kvmetrics.lab.vllm.canary_bench import PROTECTED
    from kvmetrics.lab.vllm.patched import installed_series, patched_target

    patches = installed_series()
    found: list[tuple[str, Any]] = [("vLLM (reuses the failed KV)", VLLM)]
    for count, patch in enumerate(patches, 1):
        found.append((f"series up to {patch.stem}",
                      patched_target(patches[:count], scratch / patch.stem)))
    found.append(("KVMETRICS_RECOVERY=evict", PROTECTED))
    return found


def run(quick: bool = False) -> list[Row]:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    sharers, later = (3, 2) if quick else (7, 4)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvmetrics-bench-patches-") as scratch:
        variants = _variants(Path(scratch))
        base_scheduled, base_hits = _workload(variants[0][1], sharers, later)
        case = f"{sharers} sharers + owner, {later} later, {PREFIX}-token prefix"
        rows.append(Row("defect patches: tokens scheduled", f"{variants[0][0]}, {case}",
                        base_scheduled, "tokens"))
        rows.append(Row("defect patches: later prefix hits", f"{variants[0][0]}, {case}",
                        base_hits, "tokens"))
        for name, target in variants[1:]:
            scheduled, hits = _workload(target, sharers, later)
            rows.append(Row("defect patches: extra tokens scheduled", name,
                            scheduled - base_scheduled, "tokens"))
            rows.append(Row("defect patches: later prefix hits lost", name,
                            base_hits - hits, "tokens"))
    return rows
