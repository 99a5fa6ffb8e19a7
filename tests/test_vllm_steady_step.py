"""A decode step where nothing happened costs kvmetrics almost nothing, and loses nothing.

With a pipeline (as under ``vllm serve``) such a step records nothing: no events, no
gauge read. The gauges are still read every few steps (and no more often than a time
floor) and on every step that recorded something, and each reading equals vLLM's own
counts at that step; the counters are exactly those of a run that recorded every step.
"""

from __future__ import annotations

import pytest

from kvmetrics.lab.engine.executor import SimulatedExecutor
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.lab.engine.tokens import ExplicitTokens
from kvmetrics.lab.vllm.engine import VllmEngine
from kvmetrics.metrics import catalogue as cat
from kvmetrics.vllm import owncost, step_end
from kvmetrics.vllm import scheduler as instrumented

pytestmark = pytest.mark.vllm

CONFIG = SchedulerConfig(block_size=16, num_gpu_blocks=128, max_num_seqs=8,
                         max_num_batched_tokens=512, max_model_len=512)
REQUESTS, OUTPUT = 4, 120


def test_quiet_steps_record_nothing_and_the_gauges_stay_vllms(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The step cadence alone (the time floor would space reads further on this fast run).
    monkeypatch.setattr(step_end, "GAUGE_MIN_INTERVAL_S", 0)
    store = ExternalStoreIndex(16)
    engine = VllmEngine(CONFIG, SimulatedExecutor(None, store), store=store,
                        kvmetrics_settings={"metrics_addr": "off"})
    sched = engine.scheduler
    pipeline = sched.kvmetrics_pipeline
    record = pipeline.record
    seen: list[tuple[int, object, tuple[int, int]]] = []

    def watched(events):
        # Called from inside update_from_output: vLLM's counts are those of this step.
        seen.append((events.step, events.gauges, tuple(sched.get_request_counts())))
        record(events)

    pipeline.record = watched
    for i in range(REQUESTS):
        engine.add_request(Request(f"r{i}", ExplicitTokens(list(range(i * 100, i * 100 + 40))),
                                   OUTPUT))
    steps = engine.run()
    engine.close()
    assert steps >= OUTPUT
    # Most decode steps recorded nothing (before: every step was recorded).
    assert len(seen) <= steps // instrumented.GAUGE_EVERY + steps // 10, (len(seen), steps)
    read = [(step, g, counts) for step, g, counts in seen if g is not None]
    for step, g, (running, waiting) in read:
        assert (g.running, g.waiting + g.waiting_for_remote_kv) == (running, waiting), step
    gaps = [b[0] - a[0] for a, b in zip(read, read[1:], strict=False)]
    assert read and max(gaps) <= instrumented.GAUGE_EVERY, gaps
    assert read[-1][1].running == 0  # the last step (the finishes) was read
    finished = pipeline.totals.by_metric(cat.FINISHED_REQUESTS)
    assert sum(finished.values()) == REQUESTS


def test_a_quiet_step_is_one_call_deep() -> None:
    """On a decode step that records nothing, the only kvmetrics functions that run are
    the two overrides and the block pool's eviction counter: no helper, no guard, no
    clock, no pass-through layer of a mode that is off. One step in 64 also hands an
    in-place timing of the overrides to the CPU estimate (owncost's sample)."""
    import os
    import sys

    store = ExternalStoreIndex(16)
    engine = VllmEngine(CONFIG, SimulatedExecutor(None, store), store=store,
                        kvmetrics_settings={"metrics_addr": "off"})
    sched = engine.scheduler
    assert not sched.kvmetrics_protecting
    for i in range(REQUESTS):
        engine.add_request(Request(f"r{i}", ExplicitTokens(list(range(i * 100, i * 100 + 40))),
                                   OUTPUT))
    for _ in range(3):
        engine.step()  # admissions and prefill: recorded, not quiet
    pipeline = sched.kvmetrics_pipeline
    record = pipeline.record
    recorded: list[int] = []

    def counted(events):  # noqa: ANN001, ANN202
        recorded.append(events.step)
        record(events)

    pipeline.record = counted
    ours = os.path.dirname(instrumented.__file__) + os.sep  # not kvmetrics/lab/vllm/
    # (kvmetrics_merge: the lab's model runner handing its own events, None here; vLLM
    # never calls it.)
    allowed = {"schedule", "update_from_output", "maybe_evict_hook", "kvmetrics_merge"}
    quiet = sampled = 0
    for _ in range(3 * instrumented.GAUGE_EVERY):
        step = sched._kv.step + 1
        called: list[str] = []

        def profile(frame, event, arg, called=called):  # noqa: ANN001, ANN202
            if event == "call" and frame.f_code.co_filename.startswith(ours):
                called.append(frame.f_code.co_name)

        sys.setprofile(profile)
        try:
            engine.step()
        finally:
            sys.setprofile(None)
        if step not in recorded and step % instrumented.GAUGE_EVERY:  # (those look at
            # the time, to see whether the gauges are due)
            quiet += 1
            if (step - 1) % owncost.SAMPLE_EVERY == owncost.SAMPLE_PHASE:
                sampled += 1
                assert set(called) <= allowed | {"add"}, called
                assert called.count("add") == 2, called
                continue
            assert set(called) <= allowed, called
            assert called.count("schedule") == called.count("update_from_output") == 1
    engine.close()
    assert quiet > instrumented.GAUGE_EVERY and sampled >= 1
