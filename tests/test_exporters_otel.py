"""The OpenTelemetry exporter reports the same totals as the Prometheus page."""

from __future__ import annotations

import logging
import os

import pytest
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, Sum
from prometheus_client import CollectorRegistry, generate_latest

from kvmetrics.exporters.otel import make_provider, otlp_reader, sink_for
from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.metrics import counters_from_page, counters_from_points, pipeline_counters
from tests.helpers.otel_names import prometheus_name
from tests.helpers.otlp import OTLPReceiver
from tests.helpers.runs import exporter_run

RESOURCE = dict(model_name="opt-125m", engine="2", engine_kind="reference")


def _run(otel_sink: object) -> tuple[MetricsPipeline, str]:
    prometheus = PrometheusSink(CollectorRegistry())
    pipeline = MetricsPipeline([prometheus, otel_sink], model_name="opt-125m", engine="2")
    logging.disable(logging.ERROR)  # the run's one violation is logged on purpose
    try:
        exporter_run(pipeline)
    finally:
        logging.disable(logging.NOTSET)
    return pipeline, generate_latest(prometheus.registry).decode()


def test_in_memory_reader_totals_equal_the_prometheus_totals() -> None:
    reader = InMemoryMetricReader()
    provider = make_provider([reader], **RESOURCE)
    pipeline, page = _run(sink_for(provider))

    points = []
    data = reader.get_metrics_data()
    for rm in data.resource_metrics:
        assert rm.resource.attributes["kvmetrics.engine"] == "2"
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if isinstance(metric.data, Sum):
                    assert metric.data.is_monotonic
                    points += [(metric.name, dict(p.attributes), p.value)
                               for p in metric.data.data_points]
    otel = counters_from_points(points)
    assert otel == counters_from_page(page) == pipeline_counters(pipeline)
    assert otel[(cat.GUARD_REJECTED_INCREMENTS.name,
                 ("kvmetrics_prompt_tokens_total", "negative"))] == 1
    assert all(attrs["model_name"] == "opt-125m" and attrs["engine"] == "2"
               for _, attrs, _ in points)
    provider.shutdown()


def test_otlp_http_push_delivers_the_prometheus_totals() -> None:
    with OTLPReceiver() as receiver:
        # A long interval: the reader exports only when flushed and at shutdown.
        provider = make_provider([otlp_reader(receiver.endpoint, interval_ms=600_000)],
                                 **RESOURCE)
        pipeline, page = _run(sink_for(provider))
        assert provider.force_flush(timeout_millis=10_000)
        provider.shutdown()

    assert receiver.requests, "nothing was pushed"
    assert receiver.rejected == []
    points = receiver.sum_points()
    assert {(monotonic, temporality) for *_, monotonic, temporality in points} == {
        (True, AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE)}
    received = counters_from_points(
        (name, dict(attrs), value) for (name, attrs), value in receiver.cumulative_sums().items())
    assert received == counters_from_page(page) == pipeline_counters(pipeline)
    resource = receiver.resource_attributes()[-1]
    assert resource["service.name"] == "kvmetrics"
    assert (resource["kvmetrics.model_name"], resource["kvmetrics.engine"]) == ("opt-125m", "2")


def test_otlp_endpoint_is_completed_with_the_metrics_path() -> None:
    with OTLPReceiver() as receiver:
        base = receiver.endpoint.removesuffix("/v1/metrics")
        provider = make_provider([otlp_reader(base + "/", interval_ms=600_000)], **RESOURCE)
        pipeline = MetricsPipeline([sink_for(provider)])
        events = StepEvents(step=1)
        events.count(cat.PREEMPTIONS, 5)
        pipeline.record(events)
        provider.shutdown()
    assert receiver.rejected == []
    assert receiver.cumulative_sums()[("kvmetrics_preemptions",
                                       (("engine", "0"), ("model_name", "default")))] == 5


def _instruments() -> dict[str, tuple[str, str]]:
    """Every instrument the OTel sink pushed: name -> (kind, unit), from the SDK's data."""
    from opentelemetry.sdk.metrics.export import Gauge, Histogram

    reader = InMemoryMetricReader()
    provider = make_provider([reader], **RESOURCE)
    _run(sink_for(provider))
    found: dict[str, tuple[str, str]] = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                data = metric.data
                if isinstance(data, Sum):
                    kind = "counter" if data.is_monotonic else "gauge"
                elif isinstance(data, Histogram):
                    kind = "histogram"
                else:
                    assert isinstance(data, Gauge)
                    kind = "gauge"
                found[metric.name] = (kind, metric.unit or "")
    provider.shutdown()
    return found


def test_a_collector_re_exposes_every_instrument_under_its_catalogue_name() -> None:
    instruments = _instruments()
    # Every family with a data point in the run (all counters exist from the start).
    assert {s.base_name if s.kind == "counter" else s.name for s in cat.ALL_METRICS} \
        == set(instruments)
    translated = {prometheus_name(name, unit, kind): name
                  for name, (kind, unit) in instruments.items()}
    assert set(translated) == {s.name for s in cat.ALL_METRICS}
    # The build info in particular keeps its name (unit "1" would make it ..._ratio).
    assert instruments["kvmetrics_build_info"] == ("gauge", "")


def test_the_naming_rules_are_the_collectors() -> None:
    # Examples from the compatibility specification and the Collector's translator.
    assert prometheus_name("http.server.duration", "s", "histogram") \
        == "http_server_duration_seconds"
    assert prometheus_name("memory.usage", "By", "gauge") == "memory_usage_bytes"
    assert prometheus_name("requests.count", "1", "counter") == "requests_count_total"
    assert prometheus_name("cpu.utilization", "1", "gauge") == "cpu_utilization_ratio"
    assert prometheus_name("kvmetrics_build_info", "1", "gauge") == "kvmetrics_build_info_ratio"
    assert prometheus_name("io", "By/s", "gauge") == "io_bytes_per_second"
    assert prometheus_name("x_tokens", "{tokens}", "counter") == "x_tokens_total"


def test_replicas_pushing_to_one_collector_have_distinct_instance_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def instance_id(**kwargs: str) -> str:
        provider = make_provider([InMemoryMetricReader()], **{**RESOURCE, **kwargs})
        value = provider._sdk_config.resource.attributes["service.instance.id"]
        provider.shutdown()
        return str(value)

    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    assert instance_id(engine="0") != instance_id(engine="1")
    assert str(os.getpid()) in instance_id()
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-a")
    assert instance_id() == "pod-a"
