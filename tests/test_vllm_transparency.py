"""The instrumented scheduler makes exactly vLLM's scheduling decisions.

A long randomized run with tight memory (preemptions, capacity evictions), mixed
sync/async loads and injected load failures goes once through vLLM's own
``Scheduler`` and once through ``InstrumentedScheduler``; every step must
schedule the same requests with the same token counts and block tables, preempt
and finish the same requests, start the same loads, and every request must end
with the same tokens. The same holds for ``AsyncScheduler`` and
``InstrumentedAsyncScheduler`` driven by the async batch queue, with the
protective mode present but off (its default).
"""

from __future__ import annotations

import pytest

from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.lab.vllm.differential import random_workload, run_vllm, vllm_faithful
from kvmetrics.metrics import catalogue as cat

pytestmark = pytest.mark.vllm


def decisions(run) -> list[tuple]:
    steps = []
    for record in run.engine.records:
        out = record.vllm_output
        steps.append((
            dict(out.num_scheduled_tokens),
            sorted((s.request_id, s.num_computed_tokens, tuple(s.block_ids))
                   for s in record.output.scheduled),
            sorted(out.preempted_req_ids or ()),
            sorted(out.finished_req_ids),
            [(ld.request_id, ld.mode, ld.first_index, ld.block_ids) for ld in record.output.loads],
        ))
    return steps


@pytest.mark.parametrize(("policy", "async_scheduling"), [
    ("recompute", False), ("fail", False), ("recompute", True)])
def test_instrumented_scheduler_decides_like_vllm(policy: str, async_scheduling: bool) -> None:
    config = vllm_faithful(SchedulerConfig(
        block_size=16, num_gpu_blocks=28, max_num_seqs=8, max_num_batched_tokens=96,
        max_model_len=1024, kv_load_failure_policy=policy,
        async_scheduling=async_scheduling))
    workload = random_workload(11, 150, load_mode="mixed")
    faults = FaultPlan(rate=0.12, seed=5)
    plain = run_vllm(config, workload, faults, scheduler_cls=None, keep_records=True)
    instrumented = run_vllm(config, workload, faults, keep_records=True)

    prefix = "Async" if async_scheduling else ""
    assert type(plain.engine.scheduler).__name__ == f"{prefix}Scheduler"
    assert type(instrumented.engine.scheduler).__name__ == f"Instrumented{prefix}Scheduler"
    assert instrumented.engine.scheduler.kvmetrics_recovery == "vllm"
    assert plain.steps == instrumented.steps >= 150
    assert decisions(plain) == decisions(instrumented)
    assert plain.outcomes == instrumented.outcomes
    # The run really exercised the paths the hooks sit on.
    totals = instrumented.pipeline.totals
    # (Under async scheduling with a connector a victim still in flight is not
    # preempted: vLLM defers its blocks' free instead.)
    assert totals.get(cat.PREEMPTIONS) > 0 or async_scheduling
    assert totals.get(cat.KV_LOAD_FAILED_REQUESTS, mode="sync") > 0
    assert totals.get(cat.KV_LOAD_FAILED_REQUESTS, mode="async") > 0
    assert totals.get(cat.EVICTED_BLOCKS, cause="capacity") > 0
    assert instrumented.pipeline.violations == []
    # The plain scheduler has no kvmetrics state at all.
    assert plain.pipeline.totals.series() == {}
