"""OpenTelemetry export of the same catalogue, pushed over OTLP/HTTP.

Instrument names equal the Prometheus base names (counters without ``_total``,
which a Prometheus-side translation adds back) and units use OTel's annotation
form (``{tokens}``), which Prometheus translation drops, so a Collector that
re-exposes the stream yields exactly the catalogue names: seconds become ``s``
(the name already ends in ``_seconds``), the usage ratio ``1`` (its name already
ends in ``_ratio``), and the build info has no unit at all (with ``1`` a
Collector would rename it ``kvmetrics_build_info_ratio``).

Each process is its own OTel resource with a ``service.instance.id``, so that
replicas pushing to one Collector stay apart there (the Collector turns it into
the ``instance`` label; ``OTEL_RESOURCE_ATTRIBUTES`` can override it).
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import OTELResourceDetector, Resource

from kvmetrics import __version__
from kvmetrics.metrics.catalogue import ALL_METRICS, MetricSpec
from kvmetrics.metrics.events import GaugeReadings
from kvmetrics.metrics.logs import get_logger

_UNITS = {"seconds": "s", "ratio": "1", "": ""}
#: The most a process's exit waits for its last OTLP push. The SDK's own shutdown
#: waits up to 30 s, and the HTTP exporter retries an unresponsive collector with
#: backoff: about 33 s were measured added to every exit. Metrics must never hold up
#: a stopping engine that long.
SHUTDOWN_TIMEOUT_S = 3.0

log = get_logger("kvmetrics.exporters.otel")


def otel_unit(spec: MetricSpec) -> str:
    return _UNITS.get(spec.unit, "{" + spec.unit + "}")


def otel_name(spec: MetricSpec) -> str:
    return spec.base_name if spec.kind == "counter" else spec.name


class OTelSink:
    """Implements :class:`kvmetrics.metrics.sink.MetricSink` with the OpenTelemetry SDK."""

    def __init__(self, meter: Meter) -> None:
        #: A Counter, Histogram or Gauge per family, as its spec's kind says (the sink
        #: calls only what that kind has: add, record or set).
        self._instruments: dict[str, Any] = {}
        self._labels: dict[str, tuple[str, ...]] = {}
        for spec in ALL_METRICS:
            name, unit = otel_name(spec), otel_unit(spec)
            inst: object
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

    def bind_counter(self, spec: MetricSpec,
                     label_values: tuple[str, ...]) -> Callable[[float], None]:
        """The counter's ``add`` with this series' attributes built once (the SDK only
        reads them)."""
        add: Callable[..., None] = self._instruments[spec.name].add
        return partial(add, attributes=self._attrs(spec, label_values))

    def set(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None:
        self._instruments[spec.name].set(value, self._attrs(spec, label_values))

    def set_gauges(self, common: tuple[str, ...], readings: GaugeReadings) -> None:
        for spec, values, value in readings.samples():
            self.set(spec, common + values, value)

    def observe(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None:
        self._instruments[spec.name].record(value, self._attrs(spec, label_values))

    def info(self, spec: MetricSpec, label_values: tuple[str, ...]) -> None:
        self._instruments[spec.name].set(1, self._attrs(spec, label_values))


def default_instance_id(engine: str) -> str:
    """This process's identity among replicas: host, process id and engine index."""
    return f"{socket.gethostname()}:{os.getpid()}:{engine}"


def make_provider(readers: Sequence[MetricReader], *, model_name: str, engine: str,
                  engine_kind: str, instance_id: str | None = None) -> MeterProvider:
    """A provider whose resource names this replica; an explicit ``instance_id`` wins,
    then ``service.instance.id`` in ``OTEL_RESOURCE_ATTRIBUTES``, then host:pid:engine."""
    if instance_id is None:
        from_env = OTELResourceDetector().detect().attributes.get("service.instance.id")
        instance_id = str(from_env) if from_env else default_instance_id(engine)
    resource = Resource.create({
        "service.name": "kvmetrics",
        "service.instance.id": instance_id,
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


def shutdown_provider(provider: MeterProvider, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
    """Shut ``provider`` down (its last push included) within about ``timeout_s``; False
    when the push was cut off (the collector did not answer in time: the caller says so).

    The SDK is given ``timeout_s`` but bounds its shutdown only loosely (its exporter
    may retry past the deadline), so the shutdown runs in a daemon thread that is
    abandoned half a second after the deadline; the SDK's exit hook is removed then,
    or it would wait again at exit. A shutdown that ran to the deadline was cut by it,
    whichever of the two gave up first."""
    finished = threading.Event()

    def stop() -> None:
        try:
            provider.shutdown(timeout_millis=timeout_s * 1000)
        except Exception:  # a reader that failed: the SDK logged why
            log.debug("OTLP shutdown failed", exc_info=True)
        finally:
            finished.set()

    start = time.monotonic()
    threading.Thread(target=stop, name="kvmetrics-otlp-shutdown", daemon=True).start()
    if not finished.wait(timeout_s + 0.5):
        atexit.unregister(provider.shutdown)
        return False
    return time.monotonic() - start < timeout_s
