"""A decode step where nothing happened costs kvmetrics almost nothing, and loses nothing.

With a pipeline (as under ``vllm serve``) such a step records nothing: no events, no
gauge read. The gauges are still read every few steps and on every step that recorded
something, and each reading equals vLLM's own counts at that step; the counters are
exactly those of a run that recorded every step.
"""

from __future__ import annotations

from kvmetrics.engine.executor import SimulatedExecutor
from kvmetrics.engine.external_store import ExternalStoreIndex
from kvmetrics.engine.request import Request
from kvmetrics.engine.scheduler import SchedulerConfig
from kvmetrics.engine.tokens import ExplicitTokens
from kvmetrics.integrations.vllm import scheduler as instrumented
from kvmetrics.integrations.vllm_lab.engine import VllmEngine
from kvmetrics.metrics import catalogue as cat

CONFIG = SchedulerConfig(block_size=16, num_gpu_blocks=128, max_num_seqs=8,
                         max_num_batched_tokens=512, max_model_len=512)
REQUESTS, OUTPUT = 4, 120


def test_quiet_steps_record_nothing_and_the_gauges_stay_vllms() -> None:
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
