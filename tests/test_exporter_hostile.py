"""The scrape endpoint against hostile and broken clients (issue 20, points 1, 3, 4).

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
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvmetrics.exporters.prometheus import MetricsServer, PrometheusSink, TLSOptions, serve
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import CounterIncrement, StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.tls import TLSMaterial, make_tls_material


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
        from kvmetrics.exporters.http import ServerLimits
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


def test_connections_over_the_cap_are_refused_at_once_and_scrapes_resume() -> None:
    with running(max_connections=8) as server, ExitStack() as stack:
        held = _idle(server.port, 8)
        for s in held:
            stack.callback(s.close)
        extra = socket.create_connection(("127.0.0.1", server.port))
        with extra:
            assert _closed_by_peer(extra, within=2)
        for s in held:
            s.close()
        deadline = time.monotonic() + 10
        while True:  # the loop notices the closed sockets, then admits scrapes again
            try:
                assert _get(f"http://127.0.0.1:{server.port}/metrics")[0] == 200
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise


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
