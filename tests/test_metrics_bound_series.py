"""The pipeline's bound counter series (each sink's adder kept per label set) serve
exactly what the plain path would: a new label set appears, a sink added late gets
every later increment, a family that leaves the page is not fed from a stale adder,
and a failing adder is contained."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmetrics.exporters.otel import OTelSink
from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline

EVICTED = cat.EVICTED_BLOCKS


def _step(pipeline: MetricsPipeline, step: int, *counts: tuple[str, float]) -> None:
    events = StepEvents(step=step)
    for cause, n in counts:
        events.count(EVICTED, n, cause)
    pipeline.record(events)


def _page(sink: PrometheusSink, family: str) -> dict[tuple[str, ...], float]:
    text = generate_latest(sink.registry).decode()
    return {tuple(sample.labels.get(k, "") for k in ("cause",)): sample.value
            for fam in text_string_to_metric_families(text) if fam.name == family
            for sample in fam.samples if sample.name.endswith("_total")}


def _otel_totals(reader: InMemoryMetricReader, name: str) -> dict[str, float]:
    data = reader.get_metrics_data()
    return {point.attributes["cause"]: point.value
            for rm in data.resource_metrics for sm in rm.scope_metrics
            for metric in sm.metrics if metric.name == name
            for point in metric.data.data_points}


def test_each_label_set_reaches_every_sink_once_bound() -> None:
    prom = PrometheusSink(CollectorRegistry())
    reader = InMemoryMetricReader()
    otel = OTelSink(MeterProvider(metric_readers=[reader]).get_meter("test"))
    pipeline = MetricsPipeline([prom, otel], engine_kind="vllm")
    for step in range(1, 6):
        _step(pipeline, step, ("capacity", 2))
    _step(pipeline, 6, ("capacity", 1), ("kv_load_failure", 3))  # a new label set
    _step(pipeline, 7, ("kv_load_failure", 4))
    assert pipeline.totals.by_metric(EVICTED)[("capacity",)] == 11
    assert _page(prom, EVICTED.base_name)[("capacity",)] == 11
    assert _page(prom, EVICTED.base_name)[("kv_load_failure",)] == 7
    got = _otel_totals(reader, EVICTED.base_name)
    assert got["capacity"] == 11 and got["kv_load_failure"] == 7


def test_a_sink_added_late_gets_every_later_increment() -> None:
    first = PrometheusSink(CollectorRegistry())
    pipeline = MetricsPipeline([first], engine_kind="vllm")
    for step in range(1, 4):
        _step(pipeline, step, ("capacity", 1))
    late = PrometheusSink(CollectorRegistry())
    pipeline.add_sink(late)
    for step in range(4, 8):
        _step(pipeline, step, ("capacity", 1))
    assert _page(first, EVICTED.base_name)[("capacity",)] == 7
    assert _page(late, EVICTED.base_name)[("capacity",)] == 7


def test_a_family_that_leaves_the_page_is_not_fed_from_a_kept_adder() -> None:
    sink = PrometheusSink(CollectorRegistry())
    pipeline = MetricsPipeline([sink], engine_kind="vllm")
    for step in range(1, 4):
        _step(pipeline, step, ("capacity", 1))
    assert _page(sink, EVICTED.base_name)[("capacity",)] == 3
    pipeline.mark_absent({EVICTED.name})
    assert not any(key[0] == EVICTED.name for key in pipeline._bound)
    _step(pipeline, 4, ("capacity", 5))
    assert _page(sink, EVICTED.base_name) == {}
    assert pipeline.totals.by_metric(EVICTED) == {}


def test_a_failing_adder_is_contained_and_the_other_sinks_still_count(
        caplog: pytest.LogCaptureFixture) -> None:
    good = PrometheusSink(CollectorRegistry())

    class Broken(PrometheusSink):
        def bind_counter(self, spec, label_values):  # type: ignore[no-untyped-def]
            def add(amount: float) -> None:
                raise RuntimeError("exporter bug")
            return add

    broken = Broken(CollectorRegistry())
    pipeline = MetricsPipeline([broken, good], engine_kind="vllm")
    for step in range(1, 5):
        _step(pipeline, step, ("capacity", 1))
    assert _page(good, EVICTED.base_name)[("capacity",)] == 4
    assert sum("exporter Broken failed in inc" in r.getMessage()
               for r in caplog.records) == 1
