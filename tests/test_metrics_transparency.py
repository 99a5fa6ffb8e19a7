"""Instrumentation is transparent: the instrumented engine makes exactly the same decisions."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.workload import Workload, drive, random_workload, rig_for

RUNS = {
    "sync-recompute-preempting": dict(load_mode="sync", policy="recompute", num_gpu_blocks=14,
                                      fault_rate=0.3, block_size=8),
    # Without a local prefix cache every shared prefix goes through the connector.
    "mixed-fail": dict(load_mode="mixed", policy="fail", fault_rate=0.3, block_size=16,
                       prefix_caching=False),
    "async-recompute": dict(load_mode="async", policy="recompute", fault_rate=0.2,
                            block_size=4, async_delay_steps=2, prefix_caching=False),
}


def _workload(name: str) -> Workload:
    return random_workload(random.Random(name), n_requests=150, arrival_span=400,
                           stored_prefix_blocks=(6, 4, 2), **RUNS[name])


@pytest.mark.parametrize("name", sorted(RUNS))
def test_instrumented_engine_schedules_exactly_like_the_bare_engine(name: str) -> None:
    workload = _workload(name)
    bare = rig_for(workload)
    drive(workload, bare)

    pipeline = MetricsPipeline([PrometheusSink(CollectorRegistry())], strict=True)
    instrumented = rig_for(workload, pipeline, instrument=True)
    drive(workload, instrumented)

    assert len(instrumented.trace) == len(bare.trace) > 400
    for ours, theirs in zip(instrumented.trace, bare.trace, strict=True):
        assert ours == theirs, f"step {theirs.step} differs"
    assert {rid: (r.status, r.output_token_ids) for rid, r in instrumented.requests.items()} \
        == {rid: (r.status, r.output_token_ids) for rid, r in bare.requests.items()}
    # The instrumented run did see the recovery path (so the comparison means something).
    assert pipeline.totals.get(cat.KV_LOAD_FAILED_REQUESTS) > 0
    assert pipeline.totals.get(cat.FINISHED_REQUESTS) == len(workload.requests)
    if name.startswith("sync"):
        assert pipeline.totals.get(cat.PREEMPTIONS) > 0
