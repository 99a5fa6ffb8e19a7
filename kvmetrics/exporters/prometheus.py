"""Prometheus exposition of the catalogue through prometheus-client.

Each engine gets its own :class:`CollectorRegistry` (never the global one, so
that a host process such as vLLM keeps its own metrics apart). In multiprocess
mode the values live in ``PROMETHEUS_MULTIPROC_DIR`` and any process can serve
the sum of all of them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from kvmetrics.metrics.catalogue import (
    ALL_METRICS,
    BY_NAME,
    KV_CACHE_USAGE,
    REQUESTS,
    SERIES_OVERFLOW,
    MetricSpec,
)
from kvmetrics.metrics.events import GaugeReadings

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9400

#: How gauges of several processes combine in multiprocess mode: each engine
#: process has its own ``engine`` label, so summing live processes is exact.
_MULTIPROC_GAUGE_MODE = {"kvmetrics_kv_cache_usage_ratio": "livemax",
                         "kvmetrics_requests": "livesum",
                         "kvmetrics_build_info": "livemax"}


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


#: Label sets one family may grow to before new ones are dropped (and counted).
#: Every catalogue label but model_name/engine is enumerable (about 50 sets per
#: engine at most), so this only bites on a runaway model_name or engine value.
DEFAULT_MAX_SERIES_PER_FAMILY = 4096


class PrometheusSink:
    """Implements :class:`kvmetrics.metrics.sink.MetricSink` with prometheus-client.

    A new series is admitted only if its label values are in the catalogue's sets
    and its family is under ``max_series_per_family``; otherwise the update is
    dropped and counted in ``kvmetrics_series_overflow_total{metric}``, so a bad
    label can never grow the scrape page (or Prometheus) without bound.
    """

    def __init__(self, registry: CollectorRegistry | None = None,
                 max_series_per_family: int = DEFAULT_MAX_SERIES_PER_FAMILY) -> None:
        self.multiprocess = multiprocess_dir() is not None
        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
        self.registry = registry
        target = None if self.multiprocess else registry
        # The per-step gauges are read at scrape time from the last readings, so a
        # step costs one dict store instead of four locked gauge updates. In
        # multiprocess mode the values must reach the shared files: set eagerly.
        self._step_gauges = None if self.multiprocess else _StepGauges()
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}
        for spec in ALL_METRICS:
            if self._step_gauges is not None and spec in _STEP_GAUGES:
                continue
            self._metrics[spec.name] = self._create(spec, target)
        if self._step_gauges is not None:
            registry.register(self._step_gauges)
        self._children: dict[tuple[str, tuple[str, ...]], object] = {}
        self._series: dict[str, int] = {}
        self.max_series_per_family = max_series_per_family

    @staticmethod
    def _create(spec: MetricSpec, registry: CollectorRegistry | None):
        labels = spec.label_names
        if spec.kind == "counter":
            return Counter(spec.base_name, spec.help, labels, registry=registry)
        if spec.kind == "histogram":
            return Histogram(spec.name, spec.help, labels, registry=registry,
                             buckets=spec.buckets)
        mode = _MULTIPROC_GAUGE_MODE.get(spec.name, "livesum")
        return Gauge(spec.name, spec.help, labels, registry=registry,
                     multiprocess_mode=mode)

    def _child(self, spec: MetricSpec, values: tuple[str, ...], count: bool = True):
        key = (spec.name, values)
        child = self._children.get(key)
        if child is None:
            if not self._admit(spec, values, count):
                return None
            child = self._children[key] = self._metrics[spec.name].labels(*values)
            self._series[spec.name] = self._series.get(spec.name, 0) + 1
        return child

    def _admit(self, spec: MetricSpec, values: tuple[str, ...], count: bool) -> bool:
        """First sight of a label set: bounded values and room left in the family.

        ``count=False`` for the zero-valued series created up front: refusing those
        drops nothing a user would miss, so it is not counted as overflow.
        """
        common = len(values) - len(spec.labels) - len(spec.open_labels)
        own = values[common:]
        ok = all(v in allowed for v, allowed in zip(own, spec.labels.values(), strict=False))
        if ok and spec.open_labels == ("metric",):
            ok = own[-1] in BY_NAME
        # The overflow counter itself may hold one series per family per label set.
        cap = self.max_series_per_family * (len(ALL_METRICS) if spec is SERIES_OVERFLOW else 1)
        if ok and self._series.get(spec.name, 0) < cap:
            return True
        if count and spec is not SERIES_OVERFLOW:
            overflow = self._child(SERIES_OVERFLOW, values[:common] + (spec.name,))
            if overflow is not None:
                overflow.inc()
        return False

    def inc(self, spec: MetricSpec, label_values: tuple[str, ...], amount: float) -> None:
        child = self._child(spec, label_values, count=amount != 0)
        if child is not None:
            child.inc(amount)

    def set(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None:
        child = self._child(spec, label_values)
        if child is not None:
            child.set(value)

    def set_gauges(self, common: tuple[str, ...], readings: GaugeReadings) -> None:
        """The end-of-step gauges of one engine (``common``: model_name, engine)."""
        gauges = self._step_gauges
        if gauges is None:
            self.set(KV_CACHE_USAGE, common, readings.kv_cache_usage)
            self.set(REQUESTS, common + ("running",), readings.running)
            self.set(REQUESTS, common + ("waiting",), readings.waiting)
            self.set(REQUESTS, common + ("waiting_for_remote_kv",),
                     readings.waiting_for_remote_kv)
            return
        if common not in gauges.latest and len(gauges.latest) >= self.max_series_per_family:
            overflow = self._child(SERIES_OVERFLOW, common + (KV_CACHE_USAGE.name,))
            if overflow is not None:
                overflow.inc()
            return
        gauges.latest[common] = readings

    def observe(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None:
        child = self._child(spec, label_values)
        if child is not None:
            child.observe(value)

    def info(self, spec: MetricSpec, label_values: tuple[str, ...]) -> None:
        child = self._child(spec, label_values)
        if child is not None:
            child.set(1)

    def serving_registry(self) -> CollectorRegistry:
        """The registry a scrape should read (all processes in multiprocess mode)."""
        if not self.multiprocess:
            return self.registry
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return registry

    def render(self) -> bytes:
        return generate_latest(self.serving_registry())


_STEP_GAUGES = (KV_CACHE_USAGE, REQUESTS)


class _StepGauges(Collector):
    """Exposes each engine's last GaugeReadings when Prometheus scrapes."""

    def __init__(self) -> None:
        self.latest: dict[tuple[str, ...], GaugeReadings] = {}

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (GaugeMetricFamily(KV_CACHE_USAGE.name, KV_CACHE_USAGE.help,
                                  labels=KV_CACHE_USAGE.label_names),
                GaugeMetricFamily(REQUESTS.name, REQUESTS.help, labels=REQUESTS.label_names))

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        usage, requests = self._families()
        for common, g in dict(self.latest).items():  # a copy: steps go on meanwhile
            usage.add_metric(list(common), g.kv_cache_usage)
            requests.add_metric([*common, "running"], g.running)
            requests.add_metric([*common, "waiting"], g.waiting)
            requests.add_metric([*common, "waiting_for_remote_kv"], g.waiting_for_remote_kv)
        yield usage
        yield requests


@dataclass
class TLSOptions:
    certfile: str | None = None
    keyfile: str | None = None
    client_cafile: str | None = None
    client_capath: str | None = None
    client_auth_required: bool = False


@dataclass
class MetricsServer:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    @property
    def host(self) -> str:
        return str(self.server.server_address[0])

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve(
    registry: CollectorRegistry,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    tls: TLSOptions | None = None,
) -> MetricsServer:
    """Serve ``/metrics`` on ``host:port`` (loopback unless told otherwise; port 0 picks one)."""
    tls = tls or TLSOptions()
    server, thread = start_http_server(
        port, addr=host, registry=registry,
        certfile=tls.certfile, keyfile=tls.keyfile,
        client_cafile=tls.client_cafile, client_capath=tls.client_capath,
        client_auth_required=tls.client_auth_required,
    )
    return MetricsServer(server, thread)


def parse_host_port(text: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (``[::1]:PORT`` for IPv6); raises ValueError naming the problem."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range in {text!r}")
    host = host.strip("[]") or DEFAULT_HOST
    return host, port
