"""Lab throughput on the Mooncake conversation trace (requests and tokens per second)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from benchmarks.common import Row
from kvmetrics.lab.config import LabConfig
from kvmetrics.lab.runner import run_lab

REPO = Path(__file__).resolve().parent.parent


def trace_path() -> Path:
    default = REPO / "data" / "traces" / "mooncake_conversation_trace.jsonl"
    return Path(os.environ.get("KVMETRICS_MOONCAKE_TRACE", default))


def _replay(verify: str, max_requests: int) -> tuple[float, float, float]:
    cfg = LabConfig(trace=str(trace_path()), trace_format="mooncake", max_requests=max_requests,
                    block_size=512, num_gpu_blocks=4096, max_num_seqs=16,
                    max_num_batched_tokens=16384, max_tokens=4, fault_rate=0.01,
                    fault_mode="mixed", store_blocks=65536, verify=verify,
                    verify_fraction=0.1, kv_dim=8, device="cpu", progress=False)
    summary = run_lab(cfg).summary
    wall = summary["wall_seconds"]
    p = summary["prefix_cache"]["local"]["query_tokens"]
    return summary["requests"]["submitted"] / wall, p / wall, wall


def run(quick: bool = False) -> list[Row]:
    logging.getLogger("kvmetrics").setLevel(logging.CRITICAL)
    rows = []
    for verify, n in (("off", 12031 if not quick else 2000), ("sampled", 100 if quick else 300)):
        rps, tps, wall = _replay(verify, n)
        rows.append(Row("lab throughput (Mooncake)", f"verify {verify}, {n} requests", rps,
                        "req/s"))
        rows.append(Row("lab throughput (Mooncake)", f"verify {verify}, prompt tokens", tps,
                        "tok/s"))
    return rows
