"""OpenTelemetry export of the same catalogue, pushed over OTLP/HTTP.

Instrument names equal the Prometheus base names (counters without ``_total``,
which a Prometheus-side translation adds back) and units use OTel's annotation
form (``{tokens}``), which Prometheus translation drops, so a Collector that
re-exposes the stream yields exactly the catalogue names.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from kvmetrics import __version__
from kvmetrics.metrics.catalogue import ALL_METRICS, KV_CACHE_USAGE, REQUESTS, MetricSpec
from kvmetrics.metrics.events import GaugeReadings

_UNITS = {"seconds": "s", "ratio": "1", "": "1"}


def otel_unit(spec: MetricSpec) -> str:
    return _UNITS.get(spec.unit, "{" + spec.unit + "}")


def otel_name(spec: MetricSpec) -> str:
    return spec.base_name if spec.kind == "counter" else spec.name


class OTelSink:
    """Implements :class:`kvmetrics.metrics.sink.MetricSink` with the OpenTelemetry SDK."""

    def __init__(self, meter: Meter) -> None:
        self._instruments: dict[str, object] = {}
        self._labels: dict[str, tuple[str, ...]] = {}
        for spec in ALL_METRICS:
            name, unit = otel_name(spec), otel_unit(spec)
            if spec.kind == "counter":
                inst = meter.create_counter(name, unit=unit, description=spec.help)
            elif spec.kind == "histogram":
                inst = meter.create_histogram(
                    name, unit=unit, description=spec.help,
                    explicit_bucket_boundaries_advisory=list(spec.buckets))
            else:
                inst = meter.create_gauge(name, unit=unit, description=spec.help)
            self._instruments[spec.name] = inst
            self._labels[spec.name] = spec.label_names

    def _attrs(self, spec: MetricSpec, values: tuple[str, ...]) -> dict[str, str]:
        return dict(zip(self._labels[spec.name], values, strict=True))

    def inc(self, spec: MetricSpec, label_values: tuple[str, ...], amount: float) -> None:
        self._instruments[spec.name].add(amount, self._attrs(spec, label_values))

    def set(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None:
        self._instruments[spec.name].set(value, self._attrs(spec, label_values))

    def set_gauges(self, common: tuple[str, ...], readings: GaugeReadings) -> None:
        self.set(KV_CACHE_USAGE, common, readings.kv_cache_usage)
        self.set(REQUESTS, common + ("running",), readings.running)
        self.set(REQUESTS, common + ("waiting",), readings.waiting)
        self.set(REQUESTS, common + ("waiting_for_remote_kv",), readings.waiting_for_remote_kv)

    def observe(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None:
        self._instruments[spec.name].record(value, self._attrs(spec, label_values))

    def info(self, spec: MetricSpec, label_values: tuple[str, ...]) -> None:
        self._instruments[spec.name].set(1, self._attrs(spec, label_values))


def make_provider(readers: Sequence[MetricReader], *, model_name: str, engine: str,
                  engine_kind: str) -> MeterProvider:
    resource = Resource.create({
        "service.name": "kvmetrics",
        "service.version": __version__,
        "kvmetrics.model_name": model_name,
        "kvmetrics.engine": engine,
        "kvmetrics.engine_kind": engine_kind,
    })
    return MeterProvider(metric_readers=list(readers), resource=resource)


def otlp_reader(endpoint: str, interval_ms: int = 5000, timeout_s: float = 5.0) -> MetricReader:
    """A periodic OTLP/HTTP push to ``endpoint`` (e.g. http://127.0.0.1:4318/v1/metrics)."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    if not endpoint.rstrip("/").endswith("/v1/metrics"):
        endpoint = endpoint.rstrip("/") + "/v1/metrics"
    exporter = OTLPMetricExporter(endpoint=endpoint, timeout=timeout_s)
    return PeriodicExportingMetricReader(exporter, export_interval_millis=interval_ms)


def sink_for(provider: MeterProvider) -> OTelSink:
    return OTelSink(provider.get_meter("kvmetrics", __version__))
