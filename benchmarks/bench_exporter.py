"""Exporter costs: rendering the scrape page for 1/8/64 engines (the endpoint's page vs
prometheus-client rendering the same samples, in the same run), and the guard per
increment."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    enable_created_metrics,
    generate_latest,
)

from benchmarks.common import Row, interleaved_cpu_ratios, interleaved_ratio
from kvmetrics.exporters import prometheus
from kvmetrics.exporters.pages import render_page
from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.lab import synthetic
from kvmetrics.lab.engine.executor import SimulatedExecutor
from kvmetrics.lab.engine.loop import EngineLoop
from kvmetrics.lab.engine.scheduler import Scheduler, SchedulerConfig
from kvmetrics.lab.engine_registry import make_request
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import CounterIncrement, StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline


def _populated_registry(engines: int, plain: bool = False) -> CollectorRegistry:
    """One registry holding the series of ``engines`` engines after a real run each
    (``plain``: with prometheus-client's own Counter and Histogram classes)."""
    registry = CollectorRegistry()
    if plain:
        with _plain_metric_classes():
            sink = PrometheusSink(registry, max_engines=engines)
    else:
        sink = PrometheusSink(registry, max_engines=engines)
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


@contextmanager
def _plain_metric_classes() -> Iterator[None]:
    saved = prometheus.CounterWithoutCreated, prometheus.HistogramWithoutCreated
    prometheus.CounterWithoutCreated, prometheus.HistogramWithoutCreated = Counter, Histogram
    try:
        yield
    finally:
        prometheus.CounterWithoutCreated, prometheus.HistogramWithoutCreated = saved


def run(quick: bool = False) -> list[Row]:
    rows = []
    for engines in (1, 8, 64):
        served = _populated_registry(engines)
        plain = _populated_registry(engines, plain=True)

        def ours(c=served) -> bytes:  # what the endpoint sends for GET /metrics
            return render_page(c, "GET", "/metrics", {}).body

        def theirs(r=plain) -> bytes:  # prometheus-client alone, the same samples
            disable_created_metrics()
            try:
                return generate_latest(r)
            finally:
                enable_created_metrics()

        assert ours() == theirs(), "the two sides must render the same page"
        t_ours, t_theirs, ratios = interleaved_cpu_ratios(
            ours, theirs, rounds=5 if quick else 15, number=2 if quick else 5)
        median = ratios[len(ratios) // 2]
        case = f"{engines} engines"
        rows.append(Row("scrape render", f"{case}, prometheus-client", t_theirs * 1e3, "ms"))
        rows.append(Row("scrape render", f"{case}, kvmetrics endpoint", t_ours * 1e3, "ms"))
        rows.append(Row("scrape render",
                        f"{case}, ratio (spread {ratios[0]:.2f}-{ratios[-1]:.2f})",
                        median, "x", "<= 1.2x", median <= 1.2))

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
