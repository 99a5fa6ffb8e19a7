"""The scrape endpoint against hostile and broken clients (issue 20, points 1, 3, 4;
issue 28, points 3, 4, 5, 10, 11).

Every test talks to a real endpoint on 127.0.0.1 with real sockets; waits are on
conditions (a scrape answered, a socket closed), each bounded.
"""

from __future__ import annotations

import gzip
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from benchmarks.tls import TLSMaterial, make_tls_material
from kvmetrics.exporters.http import ServerLimits
from kvmetrics.exporters.prometheus import MetricsServer, PrometheusSink, TLSOptions, serve
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import CounterIncrement, StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline

pytestmark = pytest.mark.prometheus


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TLSMaterial:
    return make_tls_material(tmp_path_factory.mktemp("tls"))


def _sink() -> PrometheusSink:
    sink = PrometheusSink(CollectorRegistry())
    pipeline = MetricsPipeline([sink], model_name="m", engine="0")
    pipeline.record(StepEvents(1, [CounterIncrement(cat.PREEMPTIONS, 3)]))
    return sink


@contextmanager
def running(tls: TLSOptions | None = None, **limits: object) -> Iterator[MetricsServer]:
    kwargs = {}
    if limits:
        kwargs["limits"] = ServerLimits(**limits)  # type: ignore[arg-type]
    server = serve(_sink().serving_registry(), port=0, tls=tls, **kwargs)
    try:
        yield server
    finally:
        server.stop()


def _mtls(material: TLSMaterial) -> TLSOptions:
    return TLSOptions(certfile=str(material.server_cert), keyfile=str(material.server_key),
                      client_cafile=str(material.ca_cert), client_auth_required=True)


def _get(url: str, timeout: float = 5.0, context: ssl.SSLContext | None = None,
         method: str = "GET", headers: dict[str, str] | None = None):
    request = urllib.request.Request(url, method=method, headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
        return response.status, dict(response.headers), response.read()


def _wait_for(condition: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _idle(port: int, count: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]


# -- 1: one idle connection must not stop TLS scrapes ---------------------------------


def test_an_idle_tcp_connection_does_not_stall_tls_scrapes(tls: TLSMaterial) -> None:
    with running(_mtls(tls)) as server, ExitStack() as stack:
        for s in _idle(server.port, 3):  # no ClientHello, ever
            stack.callback(s.close)
        status, _, body = _get(f"https://127.0.0.1:{server.port}/metrics",
                               context=tls.client_context())
        assert status == 200 and b"kvmetrics_preemptions_total" in body


def test_a_tls_client_without_certificate_is_refused_in_the_handshake(
        tls: TLSMaterial) -> None:
    with running(_mtls(tls)) as server:
        url = f"https://127.0.0.1:{server.port}/metrics"
        with pytest.raises(OSError):
            _get(url, context=tls.client_context(with_cert=False))
        with pytest.raises(OSError):  # plain HTTP gets no page either
            _get(f"http://127.0.0.1:{server.port}/metrics")
        assert _get(url, context=tls.client_context())[0] == 200


# -- 3: backlog, idle connections, connection cap -------------------------------------


def _listen_backlog(port: int) -> int:
    """The listening socket's backlog as the kernel reports it (``ss``'s Send-Q)."""
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True,
                         text=True, timeout=10, check=True).stdout.split()
    return int(out[2])


def test_listen_backlog_is_not_five() -> None:
    with running() as server:
        assert _listen_backlog(server.port) >= 128


def test_idle_connections_hold_no_thread_each() -> None:
    with running() as server, ExitStack() as stack:
        assert _get(f"http://127.0.0.1:{server.port}/metrics")[0] == 200
        before = threading.active_count()
        for s in _idle(server.port, 200):
            stack.callback(s.close)
        assert _get(f"http://127.0.0.1:{server.port}/metrics")[0] == 200
        # threads of a thread-per-connection server start at accept, before the scrape
        assert threading.active_count() - before < 5


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_and_slow_connections_are_closed_after_the_header_timeout() -> None:
    with running(header_timeout_s=0.5) as server:
        idle = socket.create_connection(("127.0.0.1", server.port))
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finishes its head
        with idle, slow:
            assert _closed_by_peer(idle, within=10)
            assert _closed_by_peer(slow, within=10)


def test_at_the_cap_the_oldest_idle_connection_makes_room() -> None:
    with running(max_connections=8) as server, ExitStack() as stack:
        held = _idle(server.port, 8)
        for s in held:
            stack.callback(s.close)
        _wait_for(lambda: server.endpoint.stats.accepted >= 8)
        assert _get(f"http://127.0.0.1:{server.port}/metrics")[0] == 200
        assert _closed_by_peer(held[0], within=2)  # the oldest, never sent a request
        assert not _closed_by_peer(held[-1], within=0.2)


def test_slow_loris_clients_do_not_delay_scrapes() -> None:
    with running() as server, ExitStack() as stack:
        for s in _idle(server.port, 20):
            stack.callback(s.close)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
        for _ in range(5):
            assert _get(f"http://127.0.0.1:{server.port}/metrics", timeout=2)[0] == 200


# -- 4: name[] filtering, HEAD, negotiation -------------------------------------------


def test_name_filter_returns_just_that_series() -> None:
    with running() as server:
        url = f"http://127.0.0.1:{server.port}/metrics?name[]=kvmetrics_preemptions_total"
        status, _, body = _get(url)
    assert status == 200
    samples = [s for f in text_string_to_metric_families(body.decode()) for s in f.samples]
    assert [(s.name, s.value) for s in samples] == [("kvmetrics_preemptions_total", 3.0)]


def test_name_filter_through_prometheus_clients_restricted_registry() -> None:
    registry = _sink().serving_registry()
    names = {s.name for f in registry.restricted_registry(["kvmetrics_preemptions_total"])
             .collect() for s in f.samples}
    assert names == {"kvmetrics_preemptions_total"}


def test_head_answers_like_get_without_a_body() -> None:
    with running() as server:
        url = f"http://127.0.0.1:{server.port}/metrics"
        status, headers, body = _get(url, method="HEAD")
        _, get_headers, get_body = _get(url)
    assert status == 200 and body == b""
    assert headers["Content-Type"] == get_headers["Content-Type"]
    assert int(headers["Content-Length"]) > 0


def test_other_methods_are_405_with_allow() -> None:
    with running() as server, pytest.raises(urllib.error.HTTPError) as e:
        _get(f"http://127.0.0.1:{server.port}/metrics", method="POST")
    assert e.value.code == 405 and "GET" in e.value.headers["Allow"]


def test_gzip_and_openmetrics_are_negotiated(tls: TLSMaterial) -> None:
    with running() as server:
        url = f"http://127.0.0.1:{server.port}/metrics"
        _, headers, body = _get(url, headers={"Accept-Encoding": "gzip"})
        assert headers["Content-Encoding"] == "gzip"
        assert b"kvmetrics_preemptions_total" in gzip.decompress(body)
        _, headers, body = _get(url, headers={
            "Accept": "application/openmetrics-text; version=1.0.0"})
        assert headers["Content-Type"].startswith("application/openmetrics-text")
        assert body.endswith(b"# EOF\n")


def test_keep_alive_serves_several_requests_on_one_connection() -> None:
    import http.client

    with running() as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        try:
            for _ in range(3):
                conn.request("GET", "/metrics")
                response = conn.getresponse()
                assert response.status == 200 and response.read()
        finally:
            conn.close()


def test_malformed_requests_get_a_4xx_not_a_stall() -> None:
    with running() as server:
        for raw in (b"NONSENSE\r\n\r\n", b"GET /metrics HTTP/9.9\r\n\r\n",
                    b"GET /metrics HTTP/1.1\r\nbad header\r\n\r\n",
                    b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                s.sendall(raw)
                answer = s.recv(64)
            assert answer.startswith(b"HTTP/1.1 4") or answer.startswith(b"HTTP/1.1 5"), raw[:30]


def test_tls_page_passes_promtool(tls: TLSMaterial, tmp_path: Path) -> None:
    with running(_mtls(tls)) as server:
        _, _, body = _get(f"https://127.0.0.1:{server.port}/metrics",
                          context=tls.client_context())
    check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True,
                           timeout=60)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), \
        check


# -- issue 28 --------------------------------------------------------------------------


class _Counting(Collector):
    """One counter family; counts how often the endpoint collected it."""

    def __init__(self) -> None:
        self.collections = 0

    def collect(self) -> Iterator[Metric]:
        self.collections += 1
        yield CounterMetricFamily("flood_probe", "collections so far", value=self.collections)


def _flood(port: int, clients: int, seconds: float, statuses: dict[int, int] | None = None
           ) -> int:
    """``clients`` keep-alive clients asking for pages back to back for ``seconds``;
    pages received in that time (and every answer's status counted in ``statuses``)."""
    import http.client

    stop = time.monotonic() + seconds
    received = [0] * clients
    seen: dict[int, int] = {} if statuses is None else statuses

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            while time.monotonic() < stop:
                conn.request("GET", "/metrics")
                response = conn.getresponse()
                body = response.read()
                seen[response.status] = seen.get(response.status, 0) + 1
                assert response.status in (200, 429) and body
                received[i] += response.status == 200 and time.monotonic() < stop
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 15)
    return sum(received)


def test_a_scrape_flood_collects_at_most_once_per_page_age() -> None:
    registry = CollectorRegistry()
    probe = _Counting()
    registry.register(probe)
    server = serve(registry, port=0, limits=ServerLimits(page_max_age_s=0.5,
                                                         max_requests_per_s=0))
    try:
        pages = _flood(server.port, clients=8, seconds=1.5)
    finally:
        server.stop()
    assert pages > 20  # the flood did ask for many pages...
    assert probe.collections <= 5  # ...collected once per 0.5 s window (1.5 s: 3-4)


def test_a_scrape_sees_values_at_most_page_age_old() -> None:
    sink = _sink()
    server = serve(sink.serving_registry(), port=0, limits=ServerLimits(page_max_age_s=0.3))
    url = f"http://127.0.0.1:{server.port}/metrics?name[]=kvmetrics_preemptions_total"
    try:
        assert b"} 3.0" in _get(url)[2]
        sink.inc(cat.PREEMPTIONS, ("m", "0"), 2)
        time.sleep(0.35)
        assert b"} 5.0" in _get(url)[2]
    finally:
        server.stop()


def test_requests_are_answered_at_most_at_the_configured_rate() -> None:
    statuses: dict[int, int] = {}
    with running(max_requests_per_s=10) as server:
        pages = _flood(server.port, clients=8, seconds=1.0, statuses=statuses)
    assert 5 <= pages <= 10 + 10 * 1.0 + 3  # the burst, then 10 a second
    # the others were answered 429 at once, not queued (a queue answers them later)
    assert statuses.get(429, 0) > pages


def _client_hello() -> bytes:
    """A TLS ClientHello, as a client sends it first (then this one stalls)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    return outgoing.read()


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_pending_tls_handshakes_hold_bounded_memory(tls: TLSMaterial) -> None:
    hello = _client_hello()
    with running(_mtls(tls)) as server, ExitStack() as stack:
        _get(f"https://127.0.0.1:{server.port}/metrics", context=tls.client_context())
        before = _rss_mb()
        for s in _idle(server.port, 400):
            stack.callback(s.close)
            s.sendall(hello)  # then never answers the server's reply
        _wait_for(lambda: server.endpoint.stats.accepted >= 401)
        time.sleep(0.5)  # the loop reads the ClientHellos and starts what it will start
        grown = _rss_mb() - before
        # a scrape still gets through (it takes the oldest pending handshake's slot)
        assert _get(f"https://127.0.0.1:{server.port}/metrics",
                    context=tls.client_context())[0] == 200
    assert grown < 40, f"{grown:.0f} MB for 400 pending handshakes"  # was ~120 MB


def test_each_tls_connection_reads_through_the_small_buffer() -> None:
    """kvmetrics.exporters.lean_tls relies on asyncio's private SSLProtocol: it sizes
    each connection's read buffer by ``max_size`` and keeps the application's transport
    in ``_app_transport``. On the Python that runs the suite, it still does."""
    import asyncio

    from kvmetrics.exporters.lean_tls import LeanSSLProtocol

    loop = asyncio.new_event_loop()
    try:
        protocol = LeanSSLProtocol(loop, asyncio.Protocol(),
                                   ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER),
                                   loop.create_future(), server_side=True)
        assert len(protocol._ssl_buffer) == 16 * 1024
        assert hasattr(protocol, "_app_transport")
    finally:
        loop.close()


def test_a_scrape_gets_through_1500_idle_connections() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:  # both ends of 1,500 connections live in this process
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    try:
        # a deep backlog only so that opening them here needs no SYN retransmits
        with running(backlog=2048) as server, ExitStack() as stack:
            for s in _idle(server.port, 1500):
                stack.callback(s.close)
            for _ in range(5):
                assert _get(f"http://127.0.0.1:{server.port}/metrics", timeout=5)[0] == 200
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _raw(port: int, request: bytes, read: int = 65536) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := s.recv(read):
            answer += chunk
        return answer


def test_unknown_openmetrics_versions_fall_back_to_text(
        caplog: pytest.LogCaptureFixture) -> None:
    with running() as server:
        for version in ("x.y", "0.0.1", "99"):
            status, headers, body = _get(f"http://127.0.0.1:{server.port}/metrics", headers={
                "Accept": f"application/openmetrics-text;version={version}"})
            assert status == 200 and headers["Content-Type"].startswith("text/plain")
            assert b"kvmetrics_preemptions_total" in body
    assert not [r for r in caplog.records if r.exc_info]


def test_accept_header_bytes_never_reach_response_headers() -> None:
    with running() as server:
        answer = _raw(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      b"Accept: application/openmetrics-text;version=2.0.0\nX-Injected: yes"
                      b"\r\n\r\n")
    head = answer.partition(b"\r\n\r\n")[0]
    assert head.startswith(b"HTTP/1.1 200")
    assert b"X-Injected" not in head and b"\n" not in head.replace(b"\r\n", b"")


def test_a_1_mb_header_line_gets_431_not_a_reset() -> None:
    with running() as server:
        answer = _raw(server.port, b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 1_000_000 +
                      b"\r\n\r\n", read=64)
    assert answer.startswith(b"HTTP/1.1 431")


def test_page_age_and_rate_come_from_the_environment(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVMETRICS_SCRAPE_MAX_AGE_S", "2.5")
    monkeypatch.setenv("KVMETRICS_SCRAPE_RATE", "nan")
    with running() as server:
        limits = server.endpoint.pages.max_age_s, server.endpoint.rate.rate
    assert limits == (2.5, ServerLimits().max_requests_per_s)
    assert [r.message for r in caplog.records if "KVMETRICS_SCRAPE_RATE" in r.message]


@pytest.mark.parametrize("accept", [
    "", "text/plain", "application/openmetrics-text",
    "application/openmetrics-text; version=1.0.0",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
    "text/plain;version=0.0.4;q=0.4,*/*;q=0.1",
    "application/openmetrics-text; version=2.0.0; escaping=dots",
    "text/plain; version=1.0.0; escaping=values", "application/json, text/plain;version=1.0.0",
])
def test_valid_accept_headers_negotiate_as_prometheus_client_does(accept: str) -> None:
    from prometheus_client.exposition import choose_encoder

    from kvmetrics.exporters.pages import negotiate

    assert negotiate(accept).content_type == choose_encoder(accept)[1]


class _Broken(Collector):
    def collect(self) -> Iterator[Metric]:
        raise RuntimeError("collector broke")


def test_a_failing_render_is_a_500_logged_once_not_per_request(
        caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    registry.register(_Broken())
    server = serve(registry, port=0, limits=ServerLimits(page_max_age_s=0))
    try:
        for _ in range(5):
            with pytest.raises(urllib.error.HTTPError) as e:
                _get(f"http://127.0.0.1:{server.port}/metrics")
            assert e.value.code == 500
    finally:
        server.stop()
    lines = [r for r in caplog.records if r.name == "kvmetrics.http"]
    assert len(lines) == 1 and "collector broke" in lines[0].getMessage()
