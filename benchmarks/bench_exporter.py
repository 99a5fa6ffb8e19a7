"""Exporter costs: rendering the scrape page for 1/8/64 engines, and the guard per increment."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from benchmarks.common import Row, best_time, interleaved_ratio
from kvmetrics.engine.executor import SimulatedExecutor
from kvmetrics.engine.loop import EngineLoop
from kvmetrics.engine.scheduler import Scheduler, SchedulerConfig
from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.lab import synthetic
from kvmetrics.lab.engines import make_request
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import CounterIncrement, StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline


def _populated_registry(engines: int) -> CollectorRegistry:
    """One registry holding the series of ``engines`` engines after a real run each."""
    registry = CollectorRegistry()
    sink = PrometheusSink(registry)
    items = synthetic.generate("mixed", 60, seed=1)
    for e in range(engines):
        sched = Scheduler(SchedulerConfig(num_gpu_blocks=256))
        pipeline = MetricsPipeline([sink], engine=str(e))
        for item in items:
            sched.add_request(make_request(item, 8))
        loop = EngineLoop(sched, SimulatedExecutor())
        while loop.busy():
            loop.step()
            for events in sched.drain_events():
                pipeline.record(events)
    return registry


def run(quick: bool = False) -> list[Row]:
    rows = []
    for engines in (1, 8, 64):
        registry = _populated_registry(engines)
        t = best_time(lambda r=registry: generate_latest(r), repeat=3 if quick else 10)
        target = "< 5 ms" if engines == 8 else ""
        rows.append(Row("scrape render", f"{engines} engines", t * 1e3, "ms", target,
                        (t < 0.005) if engines == 8 else None))

    # Guard: a guarded increment through the pipeline vs a bare prometheus-client inc
    # of the same labelled series, as an engine without kvmetrics would write it.
    n = 20_000
    bare_counter = Counter("bench_bare", "bare", ["model_name", "engine", "source", "admission"],
                           registry=CollectorRegistry())
    pipeline = MetricsPipeline([PrometheusSink()], check_invariants=False)
    events = StepEvents(step=1, increments=[
        CounterIncrement(cat.PREFIX_CACHE_HIT_TOKENS, 16, ("local", "first"))] * n)

    def bare() -> None:
        for _ in range(n):
            bare_counter.labels("default", "0", "local", "first").inc(16)

    def guarded() -> None:
        pipeline.record(events)

    tg, tb, ratio = interleaved_ratio(guarded, bare, rounds=3 if quick else 7)
    rows.append(Row("guard per increment", "bare prometheus-client inc", tb / n * 1e6, "us"))
    rows.append(Row("guard per increment", "guarded pipeline increment", tg / n * 1e6, "us"))
    rows.append(Row("guard per increment", "ratio guarded/bare", ratio, "x", "<= 1.5x",
                    ratio <= 1.5))
    return rows
