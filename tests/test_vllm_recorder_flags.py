"""The recorder's three flags tell the truth on every call, and a step is never lost.

A quiet step reads three flags of :class:`StepRecorder` instead of its containers and
event lists. A path that changed them without its flag would make the scheduler skip a
step that had something to record, so: the flags are checked against the containers
after every recorder call of a run with everything in it (sync and async loads failing,
preemptions under tight memory, finishes), the counters of that run (quiet steps
skipped) equal those of the same run recording every step, and a forgotten flag is
caught and counted by the scheduler's own check instead of passing silently.
"""

from __future__ import annotations

import functools

import pytest

from kvmetrics.lab.engine.executor import SimulatedExecutor
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.lab.engine.tokens import ExplicitTokens
from kvmetrics.lab.vllm.differential import (
    random_workload,
    run_vllm,
    vllm_faithful,
)
from kvmetrics.lab.vllm.engine import VllmEngine
from kvmetrics.metrics import catalogue as cat
from kvmetrics.vllm import step_end
from kvmetrics.vllm.recorder import StepRecorder
from tests.helpers.metrics import event_totals

pytestmark = pytest.mark.vllm

CONFIG = vllm_faithful(SchedulerConfig(block_size=16, num_gpu_blocks=30, max_num_seqs=8,
                                       max_num_batched_tokens=128, max_model_len=1024,
                                       kv_load_failure_policy="recompute"))
CHANGERS = ("allocated", "lookup", "scheduled", "loads_done", "rolled_back", "preempted",
            "finished", "evicted", "set_evict_cause", "merge_events", "recovery_time",
            "take_step")


def flags_hold(kv: StepRecorder) -> None:
    assert kv.schedule_work == bool(kv.new_loads or kv.redo)
    assert kv.output_work == bool(kv.sync_loads or kv.async_loads)
    ev = kv.events
    if ev.increments or ev.rollbacks or ev.discarded_tokens or ev.recovery_seconds:
        assert kv.must_record


@pytest.mark.parametrize("mode", ["sync", "async", "mixed"])
def test_flags_match_the_containers_and_nothing_is_lost(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {name: 0 for name in CHANGERS}
    for name in CHANGERS:
        method = getattr(StepRecorder, name)

        @functools.wraps(method)
        def checked(self, *args, _method=method, _name=name, **kwargs):  # noqa: ANN001, ANN202
            result = _method(self, *args, **kwargs)
            calls[_name] += 1
            flags_hold(self)
            return result

        monkeypatch.setattr(StepRecorder, name, checked)
    workload = random_workload(4, 60, load_mode=mode)
    faults = FaultPlan(rate=0.15, seed=4)
    # Quiet steps skipped, as under vllm serve (the scheduler owns a pipeline) ...
    skipping = run_vllm(CONFIG, workload, faults, kvmetrics_settings={"metrics_addr": "off"})
    pipeline = skipping.engine.scheduler.kvmetrics_pipeline
    # ... against every step recorded (the lab drains each step's events).
    every = run_vllm(CONFIG, workload, faults)
    assert skipping.outcomes == every.outcomes
    assert event_totals(pipeline) == event_totals(every.pipeline)
    totals = pipeline.totals
    assert totals.get(cat.KV_LOAD_BLOCKS, outcome="failed") > 0
    assert totals.get(cat.PREEMPTIONS) > 0 and totals.get(cat.ROLLED_BACK_TOKENS) > 0
    assert totals.get(cat.INSTRUMENTATION_ERRORS) == 0
    assert all(calls[name] for name in ("lookup", "scheduled", "loads_done", "rolled_back",
                                        "preempted", "finished", "take_step")), calls


def test_an_unflagged_event_is_caught_and_still_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_end, "GAUGE_MIN_INTERVAL_S", 0)
    store = ExternalStoreIndex(16)
    engine = VllmEngine(CONFIG, SimulatedExecutor(None, store), store=store,
                        kvmetrics_settings={"metrics_addr": "off"})
    sched = engine.scheduler
    engine.add_request(Request("r0", ExplicitTokens(list(range(40))), 200))
    for _ in range(4):
        engine.step()  # admission and prefill: recorded
    assert not sched._kv.must_record
    # What a recorder path that forgot its flag would leave: an event, flag down.
    sched._kv.events.count(cat.PREEMPTIONS, 1, request_id="r0")
    for _ in range(2 * step_end.GAUGE_EVERY):
        engine.step()
    totals = sched.kvmetrics_pipeline.totals
    engine.close()
    assert totals.get(cat.PREEMPTIONS) == 1  # recorded with the next periodic step
    assert totals.get(cat.INSTRUMENTATION_ERRORS, hook="scheduler.update_from_output") == 1
