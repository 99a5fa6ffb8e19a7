"""The same workload and fault plan through the reference engine and through vLLM.

Per-request outcomes (finish reason, output tokens), step counts and every
counter total must be equal. The runs use the built-in store connector and the
pure model runner on both sides, and vLLM's own scheduler defaults
(``scheduler_reserve_full_isl`` on). Two pairings are exact:

- ``vllm_faithful``: vLLM 0.33 as it is, against the reference engine
  reproducing its recovery-path defects (docs/vllm-defects.md);
- ``kvmetrics_fix``: vLLM's scheduler with kvmetrics' protective mode
  (``KVMETRICS_RECOVERY=evict``) against the reference engine's complete fix.

Both in lockstep and under async scheduling (vLLM's default on GPUs: a batch
queue of two, deferred block frees with a ``kv_both`` connector), with memory
tight enough to preempt and evict.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.lab.vllm.differential import (
    RunResult,
    Workload,
    kvmetrics_fix,
    random_workload,
    run_reference,
    run_vllm,
    vllm_faithful,
)
from kvmetrics.metrics import catalogue as cat
from tests.helpers.metrics import event_totals

pytestmark = pytest.mark.vllm

PAIRINGS: dict[str, Callable[[SchedulerConfig], SchedulerConfig]] = {
    "faithful": vllm_faithful, "fix": kvmetrics_fix}


def config(policy: str, blocks: int, pairing: str = "faithful", **kw: object) -> SchedulerConfig:
    base = SchedulerConfig(block_size=16, num_gpu_blocks=blocks, max_num_seqs=8,
                           max_num_batched_tokens=128, max_model_len=1024,
                           kv_load_failure_policy=policy, **kw)  # type: ignore[arg-type]
    return PAIRINGS[pairing](base)


def assert_same(ref: RunResult, vllm: RunResult) -> None:
    assert ref.outcomes == vllm.outcomes
    assert ref.steps == vllm.steps
    assert event_totals(ref.pipeline) == event_totals(vllm.pipeline)
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
    vllm = run_vllm(cfg, workload, faults)
    assert_same(ref, vllm)
    totals = vllm.pipeline.totals
    assert totals.get(cat.KV_LOAD_BLOCKS, outcome="failed") > 0
    assert totals.get(cat.KV_LOAD_FAILED_REQUESTS) > 0
    assert totals.get(cat.PREFIX_CACHE_HIT_TOKENS, source="local") > 0
    assert totals.get(cat.PREFIX_CACHE_HIT_TOKENS, source="external") > 0


def tight(policy: str, seed: int, mode: str = "sync", pairing: str = "faithful",
          **kw: object) -> tuple[SchedulerConfig, Workload]:
    return config(policy, 30, pairing, **kw), random_workload(seed, 60, load_mode=mode)


@pytest.mark.parametrize(("policy", "seed"), [("recompute", 1), ("fail", 0), ("recompute", 6)])
def test_tight_memory_sync_loads_agree(policy: str, seed: int) -> None:
    cfg, workload = tight(policy, seed)
    faults = FaultPlan(rate=0.15, seed=seed)
    vllm = run_vllm(cfg, workload, faults)
    assert_same(run_reference(cfg, workload, faults), vllm)
    assert vllm.pipeline.totals.get(cat.PREEMPTIONS) > 0
    assert vllm.pipeline.totals.get(cat.EVICTED_BLOCKS, cause="capacity") > 0


@pytest.mark.parametrize(("policy", "seed"), [("recompute", 2), ("fail", 3)])
def test_tight_memory_async_loads_agree(policy: str, seed: int) -> None:
    cfg, workload = tight(policy, seed, mode="async")
    faults = FaultPlan(rate=0.15, seed=seed)
    vllm = run_vllm(cfg, workload, faults)
    assert_same(run_reference(cfg, workload, faults), vllm)
    assert vllm.pipeline.totals.get(cat.KV_LOAD_BLOCKS, mode="async", outcome="failed") > 0


@pytest.mark.parametrize(("mode", "policy", "seed", "pairing"), [
    ("sync", "recompute", 1, "faithful"), ("mixed", "recompute", 4, "faithful"),
    ("async", "fail", 3, "faithful"), ("mixed", "recompute", 4, "fix"),
    ("sync", "fail", 0, "fix"), ("async", "recompute", 2, "fix"),
])
def test_async_scheduling_agrees_under_faults_and_memory_pressure(
        mode: str, policy: str, seed: int, pairing: str) -> None:
    cfg, workload = tight(policy, seed, mode, pairing, async_scheduling=True)
    faults = FaultPlan(rate=0.15, seed=seed)
    vllm = run_vllm(cfg, workload, faults)
    assert_same(run_reference(cfg, workload, faults), vllm)
    sched = vllm.engine.scheduler
    # vLLM ran as a GPU deployment does: two batches in flight, frees deferred.
    assert type(sched).__name__ == "InstrumentedAsyncScheduler"
    assert sched.defer_block_free and sched.processed_step_seq == sched.sched_step_seq > 0
    totals = vllm.pipeline.totals
    assert totals.get(cat.KV_LOAD_FAILED_REQUESTS) > 0
    assert totals.get(cat.EVICTED_BLOCKS, cause="capacity") > 0
    # The batch queue matters: the same run in lockstep counts differently.
    lockstep = run_reference(config(policy, 30, pairing), workload, faults)
    assert lockstep.pipeline.totals.series() != totals.series()


@pytest.mark.parametrize("pairing", ["faithful", "fix"])
def test_a_chunk_limit_and_async_scheduling_agree(pairing: str) -> None:
    """vLLM's long_prefill_token_threshold under a small budget: recomputes go in
    chunks, so sharers of a failed block meet it part-way (chunked-recompute-sharer)."""
    cfg, workload = tight("recompute", 5, "mixed", pairing, async_scheduling=True,
                          long_prefill_token_threshold=16)
    faults = FaultPlan(rate=0.2, seed=5)
    vllm = run_vllm(cfg, workload, faults)
    assert_same(run_reference(cfg, workload, faults), vllm)
    assert vllm.pipeline.totals.get(cat.RECOMPUTED_TOKENS, cause="kv_load_failure") > 0


STALL = dict(block_size=16, num_gpu_blocks=12, max_num_seqs=8, max_num_batched_tokens=64,
             max_model_len=512, kv_load_failure_policy="recompute")


def _stall_workload() -> Workload:
    return random_workload(0, 20, load_mode="async", doc_blocks=(2, 4), suffix=(1, 20),
                           warm_docs=6)


def test_vllm_stalls_and_the_fix_finishes_on_both_engines() -> None:
    """docs/vllm-defects.md ``async-load-stall``, with vLLM's defaults: a request whose
    async load failed in every block is freed but stays in ``_inflight_prefills``;
    re-admitted as an async load it reserves its own remaining blocks, cannot fit,
    and ends the waiting scan, so the finished loads queued behind it never run.
    The reference engine reproduces it exactly; with the fix (vLLM's protective mode
    on its real scheduler) both finish, identically."""
    faults = FaultPlan(rate=0.5, seed=0)
    faithful = vllm_faithful(SchedulerConfig(**STALL))  # type: ignore[arg-type]
    for run in (run_vllm, run_reference):
        with pytest.raises(RuntimeError, match="unfinished after 400 steps"):
            run(faithful, _stall_workload(), faults, max_steps=400)
    fixed = kvmetrics_fix(faithful)
    vllm = run_vllm(fixed, _stall_workload(), faults, max_steps=400)
    assert_same(run_reference(fixed, _stall_workload(), faults, max_steps=400), vllm)
    assert all(reason is not None for reason, _ in vllm.outcomes.values())
    assert vllm.steps < 200
    assert vllm.pipeline.totals.get(cat.KV_LOAD_BLOCKS, mode="async", outcome="failed") > 0


def test_the_reference_defaults_avoid_the_stall_too() -> None:
    """SchedulerConfig's own defaults (the library's) also leave the stall out."""
    live = run_reference(SchedulerConfig(**STALL), _stall_workload(),  # type: ignore[arg-type]
                         FaultPlan(rate=0.5, seed=0), max_steps=400)
    assert all(reason is not None for reason, _ in live.outcomes.values())
