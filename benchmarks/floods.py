"""Hostile clients and one legitimate scraper, each a process of its own.

``python -m benchmarks.floods KIND PORT [CA CERT KEY]`` runs one flood against
``127.0.0.1:PORT``, switched on and off by lines on stdin (``1`` / ``0``), until stdin
closes. ``python -m benchmarks.floods scraper PORT [CA CERT KEY]`` is the scraper that
Prometheus is: one keep-alive connection, one scrape a second, 10 s timeout,
reconnecting when it was closed; a line ``report`` on stdin makes it print, as one
JSON line, every scrape finished since the last report: whether it succeeded, its
seconds, and when it started (``time.time()``).

Each runs in its own process so that neither takes GIL time from an engine measured
in the benchmark's process.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Callable

#: Flood kinds and what each client does per request.
KINDS = ("keepalive", "churn", "malformed", "oversized", "tls")
#: Clients of the keep-alive flood (each asks back to back on one connection).
KEEPALIVE_CLIENTS = 8
#: Clients of each other flood (each one a loop of new connections).
OTHER_CLIENTS = 4
SCRAPE_TIMEOUT_S = 10.0
_RESET = struct.pack("ii", 1, 0)
_GET = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


def _drain(s: socket.socket) -> None:
    """Read until the server closes (or resets, or 2 s pass)."""
    s.settimeout(2.0)
    try:
        while s.recv(65536):
            pass
    except OSError:
        pass


def _keepalive(port: int, _tls: ssl.SSLContext | None) -> Callable[[], None]:
    conn: list[http.client.HTTPConnection] = []

    def one() -> None:
        if not conn:
            conn.append(http.client.HTTPConnection("127.0.0.1", port, timeout=10))
        try:
            conn[0].request("GET", "/metrics")
            conn[0].getresponse().read()
        except (OSError, http.client.HTTPException):
            conn.pop().close()
    return one


def _churn(port: int, _tls: ssl.SSLContext | None) -> Callable[[], None]:
    def one() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(_GET)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    return one


def _malformed(port: int, _tls: ssl.SSLContext | None) -> Callable[[], None]:
    heads = (b"NONSENSE\r\n\r\n", b"GET /metrics HTTP/9.9\r\n\r\n",
             b"GET /metrics HTTP/1.1\r\nbad header\r\n\r\n")
    turn = [0]

    def one() -> None:
        turn[0] += 1
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(heads[turn[0] % len(heads)])
            _drain(s)
    return one


def _oversized(port: int, _tls: ssl.SSLContext | None) -> Callable[[], None]:
    big_head = b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 64 * 1024 + b"\r\n\r\n"
    body = b"b" * (1024 * 1024)
    with_body = b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    turn = [0]

    def one() -> None:
        turn[0] += 1
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            try:
                s.sendall(big_head if turn[0] % 2 else with_body + body)
            except OSError:
                return  # refused mid-send: what a bounded server does
            _drain(s)
    return one


def _tls_churn(port: int, tls: ssl.SSLContext | None) -> Callable[[], None]:
    """A handshake without a client certificate (the server refuses it), then away."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE

    def one() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            try:
                with context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                    s.sendall(_GET)
                    s.recv(1)
            except (OSError, ssl.SSLError):
                pass
    return one


_MAKERS = {"keepalive": _keepalive, "churn": _churn, "malformed": _malformed,
           "oversized": _oversized, "tls": _tls_churn}


def flood(kind: str, port: int, tls: ssl.SSLContext | None) -> None:
    on = threading.Event()

    def client() -> None:
        one = _MAKERS[kind](port, tls)
        while True:
            on.wait()
            try:
                one()
            except OSError:
                time.sleep(0.01)  # refused or reset at connect: try again

    clients = KEEPALIVE_CLIENTS if kind == "keepalive" else OTHER_CLIENTS
    for _ in range(clients):
        threading.Thread(target=client, daemon=True).start()
    for line in sys.stdin:
        on.set() if line.strip() == "1" else on.clear()


def scraper(port: int, tls: ssl.SSLContext | None) -> None:
    lock = threading.Lock()
    outcomes: list[tuple[bool, float, float]] = []

    def scrape_forever() -> None:
        conn: http.client.HTTPConnection | None = None
        while True:
            started, started_at = time.monotonic(), time.time()
            ok = False
            try:
                if conn is None:
                    conn = (http.client.HTTPConnection("127.0.0.1", port, timeout=SCRAPE_TIMEOUT_S)
                            if tls is None else http.client.HTTPSConnection(
                                "127.0.0.1", port, timeout=SCRAPE_TIMEOUT_S, context=tls))
                conn.request("GET", "/metrics")
                response = conn.getresponse()
                ok = response.status == 200 and bool(response.read())
            except (OSError, http.client.HTTPException):
                if conn is not None:
                    conn.close()
                conn = None
            took = time.monotonic() - started
            with lock:
                outcomes.append((ok, took, started_at))
            time.sleep(max(0.0, 1.0 - took))

    threading.Thread(target=scrape_forever, daemon=True).start()
    for line in sys.stdin:
        if line.strip() == "report":
            with lock:
                done, outcomes[:] = list(outcomes), []
            print(json.dumps(done), flush=True)


def _context(files: list[str]) -> ssl.SSLContext | None:
    if not files:
        return None
    ca, cert, key = files
    context = ssl.create_default_context(cafile=ca)
    context.load_cert_chain(cert, key)
    return context


if __name__ == "__main__":
    kind, port_text, *tls_files = sys.argv[1:]
    (scraper if kind == "scraper" else
     lambda port, tls: flood(kind, port, tls))(int(port_text), _context(tls_files))
