"""A minimal OTLP/HTTP metrics receiver on loopback: what a Collector would be sent.

    with OTLPReceiver() as receiver:
        reader = otlp_reader(receiver.endpoint)
        ...
        receiver.cumulative_sums()   # {(name, attrs): latest value}
"""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import AggregationTemporality

Attrs = tuple[tuple[str, str], ...]


def _value(v: AnyValue) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


class OTLPReceiver:
    def __init__(self, path: str = "/v1/metrics") -> None:
        self.path = path
        self.requests: list[ExportMetricsServiceRequest] = []
        self.rejected: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != receiver.path:
                    receiver.rejected.append(self.path)
                    self.send_error(404)
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                message = ExportMetricsServiceRequest()
                message.ParseFromString(body)
                with receiver._lock:
                    receiver.requests.append(message)
                payload = ExportMetricsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}{self.path}"

    def __enter__(self) -> OTLPReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def resource_attributes(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{kv.key: _value(kv.value) for kv in rm.resource.attributes}
                    for req in self.requests for rm in req.resource_metrics]

    def sum_points(self) -> list[tuple[str, Attrs, float, int, bool, int]]:
        """Every Sum data point received: (name, attributes, value, time, monotonic,
        temporality), in arrival order."""
        out = []
        with self._lock:
            for req in self.requests:
                for rm in req.resource_metrics:
                    for sm in rm.scope_metrics:
                        for metric in sm.metrics:
                            if metric.WhichOneof("data") != "sum":
                                continue
                            s = metric.sum
                            for p in s.data_points:
                                attrs = tuple(sorted((kv.key, str(_value(kv.value)))
                                                     for kv in p.attributes))
                                value = p.as_double if p.HasField("as_double") else p.as_int
                                out.append((metric.name, attrs, float(value),
                                            p.time_unix_nano, s.is_monotonic,
                                            s.aggregation_temporality))
        return out

    def cumulative_sums(self) -> dict[tuple[str, Attrs], float]:
        """Latest value of every cumulative Sum series (what a backend would show)."""
        latest: dict[tuple[str, Attrs], tuple[int, float]] = {}
        for name, attrs, value, t, _, temporality in self.sum_points():
            if temporality != AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE:
                continue
            key = (name, attrs)
            if key not in latest or t >= latest[key][0]:
                latest[key] = (t, value)
        return {key: value for key, (_, value) in latest.items()}
