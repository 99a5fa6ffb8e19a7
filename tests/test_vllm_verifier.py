"""The data-plane verifier (full mode) on vLLM's real recovery path.

Finding (docs/vllm-defects.md, ``recompute-keeps-failed-block``): under
``kv_load_failure_policy=recompute`` vLLM does not evict the blocks of a failed sync
load; they were hashed into the prefix cache at allocation, before the load ran. If
their owner is preempted before it recomputes them, the next request to hit that prefix
(the owner itself on re-admission, or any other request) reads the poisoned block and
keeps its output. Under ``fail`` the blocks are evicted and nobody reads them.
"""

from __future__ import annotations

import pytest

from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan, ScriptedFailure
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.lab.engine.tokens import ExplicitTokens
from kvmetrics.lab.kv.runner import TorchModelRunner
from kvmetrics.lab.vllm.differential import random_workload
from kvmetrics.lab.vllm.engine import VllmEngine
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.pipeline import MetricsPipeline

pytestmark = pytest.mark.vllm

PROMPT = list(range(1000, 1064))  # 4 blocks of 16
OTHER = list(range(2000, 2032))  # 2 blocks; its 33rd token needs a third


def torch_engine(policy: str, blocks: int, faults: FaultPlan, store_blocks: int = 16,
                 load_mode: str = "sync", recovery: str = "vllm"
                 ) -> tuple[VllmEngine, TorchModelRunner, MetricsPipeline]:
    cfg = SchedulerConfig(block_size=16, num_gpu_blocks=blocks, max_num_seqs=8,
                          max_num_batched_tokens=256, max_model_len=1024,
                          kv_load_failure_policy=policy)
    store = ExternalStoreIndex(store_blocks)
    engines: list[VllmEngine] = []
    runner = TorchModelRunner(
        block_size=16, num_gpu_blocks=blocks, store=store, faults=faults, device="cpu",
        verify="full",
        tokens=lambda rid, start, end: list(engines[0].requests[rid].all_token_ids[start:end]))
    pipeline = MetricsPipeline()
    engine = VllmEngine(cfg, runner, store=store, load_mode=load_mode, pipeline=pipeline,
                        keep_records=True, recovery=recovery)
    engines.append(engine)
    return engine, runner, pipeline


def preempted_owner_run(policy: str, recovery: str = "vllm"
                        ) -> tuple[VllmEngine, TorchModelRunner, MetricsPipeline]:
    """a's sync load of 48 tokens fails at block #1; x's growth preempts a at once."""
    engine, runner, pipeline = torch_engine(
        policy, 7, FaultPlan(scripted=(ScriptedFailure(1, request_id="a"),)),
        recovery=recovery)
    engine.add_request(Request("w", ExplicitTokens(PROMPT), 1))  # puts real KV in the store
    engine.run()
    assert engine.scheduler.reset_prefix_cache()  # so that a's hit is external
    engine.add_request(Request("x", ExplicitTokens(OTHER), 5))
    engine.add_request(Request("a", ExplicitTokens(PROMPT), 4))
    engine.step()
    assert {s.request_id: s.num_scheduled_tokens for s in engine.records[-1].output.scheduled} \
        == {"x": 32, "a": 16}
    engine.step()  # recompute: x needs a block, a is preempted before recomputing
    expected = {"a"} if policy == "recompute" else set()  # fail: a already finished
    assert engine.records[-1].output.preempted_req_ids == expected
    engine.add_request(Request("c", ExplicitTokens(PROMPT), 2))  # same prefix, later
    engine.run()
    engine.close()
    return engine, runner, pipeline


def test_recompute_leaves_the_failed_block_hashed_and_it_is_read_stale() -> None:
    engine, runner, pipeline = preempted_owner_run("recompute")
    assert runner.findings, "expected the stale read vLLM allows under recompute"
    assert {(f.request_id, f.block_index) for f in runner.findings} == {("a", 1), ("c", 1)}
    # Both requests finished normally: their outputs were computed over poisoned KV.
    assert engine.outcome("a")[0] == engine.outcome("c")[0] == "length"
    assert pipeline.totals.get(cat.KV_VERIFICATION_FAILED_BLOCKS) == len(runner.findings)
    assert pipeline.totals.get(cat.KV_LOAD_FAILED_REQUESTS, action="rescheduled") == 1
    assert pipeline.totals.get(cat.EVICTED_BLOCKS, cause="kv_load_failure") == 0


def test_fail_policy_evicts_the_failed_blocks_and_nobody_reads_them() -> None:
    engine, runner, pipeline = preempted_owner_run("fail")
    assert engine.outcome("a") == ("error", [])
    assert engine.outcome("c")[0] == "length"
    assert runner.findings == []
    assert pipeline.totals.get(cat.KV_VERIFIED_TOKENS) > 0
    assert pipeline.totals.get(cat.KV_VERIFICATION_FAILED_BLOCKS) == 0
    assert pipeline.totals.get(cat.EVICTED_BLOCKS, cause="kv_load_failure") == 3


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_recovery_without_preemption_reads_no_stale_kv(policy: str) -> None:
    """Ample memory: every failed block is recomputed (or evicted) before anyone reads it."""
    workload = random_workload(3, 40, load_mode="mixed", eos_share=0.0)
    engine, runner, pipeline = torch_engine(policy, 1024, FaultPlan(rate=0.15, seed=3),
                                            store_blocks=256, load_mode="mixed")
    for tokens in workload.warm:  # real KV in the store: compute, then forget locally
        engine.add_request(Request(f"warm-{len(engine.requests)}",
                                   ExplicitTokens(list(tokens)), 1))
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    for spec in workload.requests:
        engine.add_request(spec.make())
    engine.run()
    engine.close()
    assert pipeline.totals.get(cat.KV_LOAD_BLOCKS, outcome="failed") > 0
    assert pipeline.totals.get(cat.PREEMPTIONS) == 0
    assert runner.findings == []
    assert pipeline.totals.get(cat.KV_VERIFIED_TOKENS) > 0


def test_the_protective_mode_evicts_the_failed_block_and_nobody_reads_it() -> None:
    """Same run with KVMETRICS_RECOVERY=evict on vLLM's real scheduler: a's blocks from
    the failed one on leave the prefix cache, so neither a (re-admitted) nor c reads
    them; both finish normally over verified KV."""
    engine, runner, pipeline = preempted_owner_run("recompute", recovery="evict")
    assert engine.scheduler.kvmetrics_recovery == "evict"
    assert runner.findings == []
    assert engine.outcome("a")[0] == engine.outcome("c")[0] == "length"
    assert pipeline.totals.get(cat.KV_VERIFIED_TOKENS) > 0
    # At least a's blocks #1..#3 (its loads of block #1 fail every time it is admitted).
    assert pipeline.totals.get(cat.EVICTED_BLOCKS, cause="kv_load_failure") >= 3


def test_the_protective_mode_is_opt_in_through_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmetrics.lab.vllm import builder

    cfg = SchedulerConfig(block_size=16, num_gpu_blocks=16, kv_load_failure_policy="recompute")
    plain = builder.build_scheduler(cfg, scheduler_cls=builder.INSTRUMENTED,
                                    kvmetrics_settings={"export": False})
    assert plain.kvmetrics_recovery == "vllm"  # observing never changes vLLM's decisions
    monkeypatch.setenv("KVMETRICS_RECOVERY", "evict")
    protected = builder.build_scheduler(cfg, scheduler_cls=builder.INSTRUMENTED_ASYNC,
                                        kvmetrics_settings={"export": False})
    assert protected.kvmetrics_recovery == "evict"
    monkeypatch.setenv("KVMETRICS_RECOVERY", "evcit")
    with pytest.raises(ValueError, match="KVMETRICS_RECOVERY must be one of vllm, evict, "
                                         "got 'evcit'"):
        builder.build_scheduler(cfg, scheduler_cls=builder.INSTRUMENTED,
                                kvmetrics_settings={"export": False})
    for sched in (plain, protected):
        sched.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_vllms_own_path_reads_stale_kv_and_the_protective_mode_does_not(
        async_scheduling: bool) -> None:
    """A faulty, memory-tight lab run on vLLM's real scheduler with every read verified:
    vLLM's recovery path lets requests read KV that was never loaded (or was computed
    over it); with its protective mode on, the same workload reads none."""
    from kvmetrics.lab.config import LabConfig
    from kvmetrics.lab.runner import run_lab

    def run(recovery: str) -> dict:
        return run_lab(LabConfig(engine="vllm", workload="chat", max_requests=60,
                                 num_gpu_blocks=60, fault_rate=0.3, abort_rate=0.2,
                                 long_prefill_token_threshold=32, seed=4,
                                 async_scheduling=async_scheduling, recovery=recovery,
                                 progress=False)).summary

    faithful, fixed = run("vllm"), run("evict")
    assert faithful["verification"]["failed_blocks"] > 0
    assert fixed["verification"]["failed_blocks"] == 0
    assert fixed["verification"]["verified_tokens"] > 0
    done = fixed["requests"]
    assert done["finished"] + done["aborted"] + done["failed"] == done["submitted"] == 60
    assert fixed["evicted_blocks"]["kv_load_failure"] > 0
