"""No client can lock a legitimate scraper out of the endpoint.

A scraper here is what Prometheus is: one keep-alive connection, one scrape a second,
reconnecting when the endpoint closed it. What is asserted is how many of its
scrapes succeed while a hostile client runs and right after it stops (counts, not
timings). Each flood lasts a few seconds; every socket is on 127.0.0.1.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
from prometheus_client import CollectorRegistry

from kvmetrics.exporters.http import ServerLimits
from kvmetrics.exporters.prometheus import MetricsServer, PrometheusSink, serve
from kvmetrics.exporters.serve_process import CHILD_LIMITS
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import CounterIncrement, StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline

#: Both servers that serve: the engine's own defaults (request-rate bound on) and the
#: exporter process' (no request-rate bound).
LIMITS = {"engine": ServerLimits(), "process": CHILD_LIMITS}
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER 0: close() sends a reset


@contextmanager
def running(limits: ServerLimits) -> Iterator[MetricsServer]:
    sink = PrometheusSink(CollectorRegistry())
    MetricsPipeline([sink], model_name="m", engine="0").record(
        StepEvents(1, [CounterIncrement(cat.PREEMPTIONS, 3)]))
    server = serve(sink.serving_registry(), port=0, limits=limits)
    try:
        yield server
    finally:
        server.stop()


class Scraper:
    """One keep-alive connection; :meth:`scrape` is True for a 200 with the page."""

    def __init__(self, port: int, timeout: float = 3.0) -> None:
        self.port, self.timeout = port, timeout
        self.conn: http.client.HTTPConnection | None = None

    def scrape(self) -> bool:
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port,
                                                       timeout=self.timeout)
            self.conn.request("GET", "/metrics")
            response = self.conn.getresponse()
            body = response.read()
            return response.status == 200 and b"kvmetrics_preemptions_total" in body
        except (OSError, http.client.HTTPException):
            self.close()
            return False

    def every(self, interval: float, count: int) -> int:
        """Successes out of ``count`` scrapes, one per ``interval`` seconds."""
        ok = 0
        for _ in range(count):
            started = time.monotonic()
            ok += self.scrape()
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
        return ok

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _churn(port: int, per_s: float, stop: threading.Event) -> None:
    """Connect, send a whole GET, reset; ``per_s`` times a second, holding no socket."""
    while not stop.is_set():
        started = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        except OSError:
            pass
        stop.wait(max(0.0, 1 / per_s - (time.monotonic() - started)))


@pytest.mark.parametrize("kind", sorted(LIMITS))
def test_connect_get_reset_churn_never_locks_the_scraper_out(kind: str) -> None:
    with running(LIMITS[kind]) as server:
        scraper = Scraper(server.port)
        assert scraper.scrape()
        stop = threading.Event()
        churn = threading.Thread(target=_churn, args=(server.port, 60, stop))
        churn.start()
        try:
            time.sleep(1.0)  # the churn is under way before the scraper counts
            during = scraper.every(1.0, 4)
        finally:
            stop.set()
            churn.join(10)
        after = scraper.every(0.5, 4)  # the 2 s after the churn stopped
        scraper.close()
    assert during == 4, f"{during}/4 scrapes during the churn"  # >= 95 %
    assert after == 4, f"{after}/4 scrapes in the 2 s after it"


def test_300_connections_with_a_request_outstanding_do_not_lock_the_scraper_out() -> None:
    """The exporter process' limits only: in the EngineCore's server the 300 requests
    draw on the request-rate bound every client shares, so on a loaded machine one of
    the scraper's three scrapes can get ``429`` (docs/endpoint.md says so); the
    exporter process has no shared bound for exactly this reason."""
    with running(LIMITS["process"]) as server, ExitStack() as stack:
        scraper = Scraper(server.port)
        stack.callback(scraper.close)
        assert scraper.scrape()
        for _ in range(300):  # each asks once and never reads its answer
            s = stack.enter_context(socket.create_connection(("127.0.0.1", server.port),
                                                             timeout=5))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        ok = scraper.every(1.0, 3)
    assert ok == 3, f"{ok}/3 scrapes"


def _answer(port: int, request: bytes) -> tuple[bytes, bool]:
    """What the endpoint answers to ``request`` and whether it then closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            return answer, False
        return answer, True


@pytest.mark.parametrize("headers", [
    b"Content-Length: 0\r\nContent-Length: 0\r\n",
    b"Content-Length: 44\r\nContent-Length: 0\r\n",
    b"content-length: 0\r\nTransfer-Encoding: chunked\r\n",
])
def test_two_body_lengths_are_a_400_and_the_connection_closes(headers: bytes) -> None:
    smuggled = b"GET /metrics HTTP/1.1\r\nHost: y\r\n\r\n"
    with running(ServerLimits()) as server:
        answer, closed = _answer(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" +
                                 headers + b"\r\n" + smuggled)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert answer.count(b"HTTP/1.1 ") == 1  # the body was never read as a request
    assert closed
