"""Prometheus exposition of the catalogue through prometheus-client.

Each engine gets its own :class:`CollectorRegistry` (never the global one, so
that a host process such as vLLM keeps its own metrics apart). In multiprocess
mode the values live in ``PROMETHEUS_MULTIPROC_DIR`` and any process can serve
the sum of all of them.
"""

from __future__ import annotations

import os
import threading
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
from prometheus_client.multiprocess import MultiProcessCollector

from kvmetrics.metrics.catalogue import ALL_METRICS, MetricSpec

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9400

#: How gauges of several processes combine in multiprocess mode: each engine
#: process has its own ``engine`` label, so summing live processes is exact.
_MULTIPROC_GAUGE_MODE = {"kvmetrics_kv_cache_usage_ratio": "livemax",
                         "kvmetrics_requests": "livesum",
                         "kvmetrics_build_info": "livemax"}


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class PrometheusSink:
    """Implements :class:`kvmetrics.metrics.sink.MetricSink` with prometheus-client."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.multiprocess = multiprocess_dir() is not None
        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
        self.registry = registry
        target = None if self.multiprocess else registry
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}
        for spec in ALL_METRICS:
            self._metrics[spec.name] = self._create(spec, target)
        self._children: dict[tuple[str, tuple[str, ...]], object] = {}

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

    def _child(self, spec: MetricSpec, values: tuple[str, ...]):
        key = (spec.name, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._metrics[spec.name].labels(*values)
        return child

    def inc(self, spec: MetricSpec, label_values: tuple[str, ...], amount: float) -> None:
        self._child(spec, label_values).inc(amount)

    def set(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None:
        self._child(spec, label_values).set(value)

    def observe(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None:
        self._child(spec, label_values).observe(value)

    def info(self, spec: MetricSpec, label_values: tuple[str, ...]) -> None:
        self._child(spec, label_values).set(1)

    def serving_registry(self) -> CollectorRegistry:
        """The registry a scrape should read (all processes in multiprocess mode)."""
        if not self.multiprocess:
            return self.registry
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return registry

    def render(self) -> bytes:
        return generate_latest(self.serving_registry())


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
