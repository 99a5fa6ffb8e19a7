"""Property test of the reference engine under random workloads, faults, aborts and pressure.

After every step the design-brief invariants must hold: the strict pipeline runs the
invariant checker and raises on any violation, and a negative or non-finite increment
in unified accounting raises too. When every request has ended no block may leak.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvmetrics.lab.engine.request import RequestStatus
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.engine import Rig, assert_no_leaks
from tests.helpers.workload import (
    RequestSpec,
    Workload,
    drive,
    ensure_progress,
    prefix_tokens,
    random_workload,
    rig_for,
)

PREFIXES = 3


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    block_size = draw(st.sampled_from((4, 8, 16)))
    prefix_blocks = 6
    prefixes = prefix_tokens(PREFIXES, prefix_blocks * block_size)
    n = draw(st.integers(3, 12))
    specs = []
    for i in range(n):
        prefix = draw(st.sampled_from((-1, 0, 0, 1, 2)))
        prefix_len = draw(st.integers(0, prefix_blocks * block_size)) if prefix >= 0 else 0
        suffix_len = draw(st.integers(1, 3 * block_size))
        max_tokens = draw(st.integers(1, 20))
        arrival = draw(st.integers(0, 15))
        abort = draw(st.none() | st.integers(0, 40))
        specs.append(RequestSpec(f"r{i}", prefix, prefix_len, suffix_len, max_tokens,
                                 arrival, abort))
    # Small caches put the runs under preemption pressure; ensure_progress grows them
    # just enough for the largest request.
    return ensure_progress(Workload(
        block_size=block_size,
        num_gpu_blocks=draw(st.integers(2, 30)),
        max_num_batched_tokens=draw(st.sampled_from((block_size, 3 * block_size, 64, 512))),
        policy=draw(st.sampled_from(("recompute", "fail"))),
        load_mode=draw(st.sampled_from(("sync", "async", "mixed"))),
        fault_rate=draw(st.sampled_from((0.0, 0.1, 0.3, 0.5))),
        fault_seed=draw(st.integers(0, 2**16)),
        async_delay_steps=draw(st.integers(0, 3)),
        stored_prefix_blocks=tuple(draw(st.integers(2, prefix_blocks))
                                   for _ in range(PREFIXES)),
        requests=tuple(specs),
        store_blocks=draw(st.sampled_from((4, 16, 256))),
        max_num_seqs=draw(st.sampled_from((1, 2, 16))),
        prefix_caching=draw(st.booleans()),
        eos_probability=draw(st.sampled_from((0.0, 0.1))),
        prefixes=prefixes,
    ))


def _check_step(rig: Rig) -> None:
    pool = rig.scheduler.pool
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks - 1
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    for request in rig.scheduler.running:
        assert 0 <= request.num_computed_tokens <= request.num_tokens


def _run_and_check(workload: Workload) -> MetricsPipeline:
    pipeline = MetricsPipeline(strict=True)
    rig = rig_for(workload, pipeline)

    drive(workload, rig, after_step=_check_step)

    assert pipeline.violations == []
    assert set(rig.requests) == {s.request_id for s in workload.requests}
    assert all(r.is_finished for r in rig.requests.values())
    assert_no_leaks(rig.scheduler)
    assert pipeline.totals.get(cat.FINISHED_REQUESTS) == len(workload.requests)
    if workload.policy == "recompute":
        errors = [r for r in rig.requests.values() if r.status is RequestStatus.FINISHED_ERROR]
        assert errors == []
    # Prompt tokens by source are recorded once per request that was ever admitted.
    admitted = sum(s.prompt_len for s in workload.requests
                   if rig.requests[s.request_id].num_lookups > 0)
    assert pipeline.totals.get(cat.PROMPT_TOKENS) == admitted
    return pipeline


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants_and_release_every_block(workload: Workload) -> None:
    pipeline = _run_and_check(workload)
    for spec in (cat.PREEMPTIONS, cat.ROLLED_BACK_TOKENS, cat.EVICTED_BLOCKS):
        event(f"{spec.name} > 0: {pipeline.totals.get(spec) > 0}")


@pytest.mark.parametrize("seed", range(60))
def test_larger_seeded_workloads_keep_invariants_and_release_every_block(seed: int) -> None:
    _run_and_check(random_workload(random.Random(seed), n_requests=24))
