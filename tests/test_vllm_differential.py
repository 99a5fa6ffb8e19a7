"""The same workload and fault plan through the reference engine and through vLLM.

Per-request outcomes (finish reason, output tokens), step counts and every
counter total must be equal. The runs use the built-in store connector and the
pure model runner on both sides; see docs/vllm.md for what differs and why.

The one deliberate difference is the admission of async loads under memory
pressure: vLLM 0.33 lets a request whose async load failed in every block keep
reserving blocks for itself at the head of the waiting queue, which can stall
the engine for good. The reference engine's default (``async_admission="live"``)
does not; with ``async_admission="vllm"`` it reproduces vLLM exactly, stall
included. The tests below assert exactly that difference and no other.
"""

from __future__ import annotations

import pytest

from kvmetrics.engine.faults import FaultPlan
from kvmetrics.engine.scheduler import SchedulerConfig
from kvmetrics.integrations.vllm.differential import (
    RunResult,
    Workload,
    random_workload,
    run_reference,
    run_vllm,
)
from kvmetrics.metrics import catalogue as cat


def config(policy: str, blocks: int) -> SchedulerConfig:
    return SchedulerConfig(block_size=16, num_gpu_blocks=blocks, max_num_seqs=8,
                           max_num_batched_tokens=128, max_model_len=1024,
                           kv_load_failure_policy=policy)


def assert_same(ref: RunResult, vllm: RunResult) -> None:
    assert ref.outcomes == vllm.outcomes
    assert ref.steps == vllm.steps
    assert ref.pipeline.totals.series() == vllm.pipeline.totals.series()
    assert ref.pipeline.violations == vllm.pipeline.violations == []


@pytest.mark.parametrize(("mode", "policy", "seed"), [
    ("sync", "recompute", 0), ("sync", "fail", 1), ("async", "recompute", 2),
    ("async", "fail", 3), ("mixed", "recompute", 4), ("mixed", "fail", 5),
])
def test_reference_and_vllm_count_the_same(mode: str, policy: str, seed: int) -> None:
    cfg = config(policy, 1024)
    workload = random_workload(seed, 60, load_mode=mode, doc_blocks=(2, 6))
    faults = FaultPlan(rate=0.15, seed=seed)
    ref = run_reference(cfg, workload, faults)
    vllm = run_vllm(cfg, workload, faults)  # vLLM's default scheduler settings
    assert_same(ref, vllm)
    totals = vllm.pipeline.totals
    assert totals.get(cat.KV_LOAD_BLOCKS, outcome="failed") > 0
    assert totals.get(cat.KV_LOAD_FAILED_REQUESTS) > 0
    assert totals.get(cat.PREFIX_CACHE_HIT_TOKENS, source="local") > 0
    assert totals.get(cat.PREFIX_CACHE_HIT_TOKENS, source="external") > 0


def tight(policy: str, seed: int, mode: str = "sync",
          async_admission: str = "live") -> tuple[SchedulerConfig, Workload]:
    cfg = SchedulerConfig(block_size=16, num_gpu_blocks=30, max_num_seqs=8,
                          max_num_batched_tokens=128, max_model_len=1024,
                          kv_load_failure_policy=policy, async_admission=async_admission)
    return cfg, random_workload(seed, 60, load_mode=mode)


@pytest.mark.parametrize(("policy", "seed"), [("recompute", 1), ("fail", 0), ("recompute", 6)])
def test_tight_memory_sync_loads_agree(policy: str, seed: int) -> None:
    cfg, workload = tight(policy, seed)
    faults = FaultPlan(rate=0.15, seed=seed)
    ref = run_reference(cfg, workload, faults)
    # The reference does not model vLLM's admission gate on the whole prompt.
    vllm = run_vllm(cfg, workload, faults)
    assert_same(ref, vllm)
    assert vllm.pipeline.totals.get(cat.PREEMPTIONS) > 0
    assert vllm.pipeline.totals.get(cat.EVICTED_BLOCKS, cause="capacity") > 0


@pytest.mark.parametrize(("policy", "seed"), [("recompute", 2), ("fail", 3)])
def test_tight_memory_async_loads_agree_in_vllm_admission_mode(policy: str, seed: int) -> None:
    cfg, workload = tight(policy, seed, mode="async", async_admission="vllm")
    faults = FaultPlan(rate=0.15, seed=seed)
    vllm = run_vllm(cfg, workload, faults)
    assert_same(run_reference(cfg, workload, faults), vllm)
    assert vllm.pipeline.totals.get(cat.KV_LOAD_BLOCKS, mode="async", outcome="failed") > 0


STALL = dict(block_size=16, num_gpu_blocks=12, max_num_seqs=8, max_num_batched_tokens=64,
             max_model_len=512, kv_load_failure_policy="recompute")


def _stall_workload() -> Workload:
    return random_workload(0, 20, load_mode="async", doc_blocks=(2, 4), suffix=(1, 20),
                           warm_docs=6)


def test_vllm_stalls_where_the_reference_finishes() -> None:
    """vLLM 0.33 finding: a request whose async load failed in every block is freed
    but stays in ``_inflight_prefills``; re-admitted as an async load it reserves
    its own remaining blocks, cannot fit, and ends the waiting scan, so the finished
    loads queued behind it never run. Nothing is running, so nothing frees blocks."""
    faults = FaultPlan(rate=0.5, seed=0)
    with pytest.raises(RuntimeError, match="unfinished after 400 steps"):
        run_vllm(SchedulerConfig(**STALL), _stall_workload(), faults, max_steps=400)
    with pytest.raises(RuntimeError, match="unfinished after 400 steps"):
        run_reference(SchedulerConfig(**STALL, async_admission="vllm"), _stall_workload(),
                      faults, max_steps=400)
    live = run_reference(SchedulerConfig(**STALL), _stall_workload(), faults, max_steps=400)
    assert all(reason is not None for reason, _ in live.outcomes.values())
    assert live.steps < 200
