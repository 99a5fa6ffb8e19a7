"""`kvmetrics run --otlp-endpoint`: the OTLP stream carries the summary's totals."""

from __future__ import annotations

import json

from tests.helpers.otlp import OTLPReceiver
from tests.lab_support import run_cli


def test_lab_pushes_the_same_totals_over_otlp() -> None:
    with OTLPReceiver() as receiver:
        result = run_cli("run", "--verify", "off", "--max-requests", "150", "--fault-rate", "0.3",
                         "--otlp-endpoint", receiver.endpoint, "--json")
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        sums = receiver.cumulative_sums()
        resources = receiver.resource_attributes()

    def total(name: str, **labels: str) -> float:
        return sum(v for (n, attrs), v in sums.items()
                   if n == name and all((k, val) in attrs for k, val in labels.items()))

    assert resources and resources[0]["kvmetrics.model_name"] == "kvmetrics-lab"
    assert total("kvmetrics_rolled_back_tokens") == summary["rolled_back_tokens"] > 0
    assert total("kvmetrics_kv_load_blocks", outcome="failed") == \
        summary["kv_load"]["blocks_failed"]
    assert total("kvmetrics_prefix_cache_hit_tokens", source="local", admission="first") == \
        summary["prefix_cache"]["local"]["hit_tokens"]
    assert total("kvmetrics_finished_requests") == 150


def test_an_unresponsive_collector_delays_the_exit_a_few_seconds_at_most() -> None:
    """A collector that takes the push and answers one byte every two seconds (each
    read within the exporter's timeout) used to add ~30 s to every exit: the SDK's
    shutdown waits up to 30 s. Now the last push is cut after SHUTDOWN_TIMEOUT_S, and
    the run says so."""
    import socket
    import threading
    import time

    from kvmetrics.exporters.otel import SHUTDOWN_TIMEOUT_S

    stop = threading.Event()

    def trickle(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 1000:
                if stop.wait(2.0):
                    return
                try:
                    conn.send(bytes([byte]))
                except OSError:
                    return

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        server.settimeout(0.2)

        def accept() -> None:
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except OSError:
                    continue
                threading.Thread(target=trickle, args=(conn,), daemon=True).start()

        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        try:
            base = time.monotonic()
            assert run_cli("run", "--verify", "off", "--max-requests", "20").returncode == 0
            plain = time.monotonic() - base
            start = time.monotonic()
            result = run_cli("run", "--verify", "off", "--max-requests", "20",
                             "--otlp-endpoint", f"http://127.0.0.1:{server.getsockname()[1]}")
            took = time.monotonic() - start
        finally:
            stop.set()
            acceptor.join()
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert f"did not take the last push within {SHUTDOWN_TIMEOUT_S:g} s" in result.stderr
    assert took < plain + SHUTDOWN_TIMEOUT_S + 5, (took, plain)
