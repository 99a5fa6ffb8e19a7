"""The scrape endpoint under hostile clients: p99 scrape latency of 10 concurrent
scrapers while 500 idle and 50 slow-loris connections are held open, against the same
scrapers with no such connections, interleaved round by round.

The endpoint runs in a process of its own (as it does inside an engine), serving one
engine's series after a real run; the scrapers and the hostile connections are threads
of this process, all on 127.0.0.1. Each scrape is a new connection (the worst case for
the endpoint). ``python -m benchmarks.bench_endpoint`` prints the details.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks.common import Row

SCRAPERS = 10
IDLE = 500
SLOW_LORIS = 50

_SERVER = """
import sys
from benchmarks.bench_exporter import _populated_registry
from kvmetrics.exporters.prometheus import serve
server = serve(_populated_registry(1), port=0)
print(server.port, flush=True)
sys.stdin.read()
server.stop()
"""


def _start_server() -> tuple[subprocess.Popen[str], int]:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    process = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=root, env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def _scrape(port: int) -> float:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        body = response.read()
        assert response.status == 200 and body, response.status
    finally:
        conn.close()
    return time.perf_counter() - t0


def _scrape_round(port: int, per_scraper: int) -> list[float]:
    latencies: list[float] = []
    lock = threading.Lock()

    def scraper() -> None:
        mine = [_scrape(port) for _ in range(per_scraper)]
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=scraper) for _ in range(SCRAPERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies


def _hostile(port: int, stack: ExitStack) -> None:
    """Open IDLE silent connections and SLOW_LORIS ones that drip a request head."""
    stop = threading.Event()
    slow: list[socket.socket] = []
    for _ in range(IDLE):
        stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
    for _ in range(SLOW_LORIS):
        s = stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        slow.append(s)

    def drip() -> None:
        while not stop.wait(0.5):
            for s in slow:
                with contextlib.suppress(OSError):  # closed by the endpoint, in the end
                    s.send(b"X")

    thread = threading.Thread(target=drip, daemon=True)
    thread.start()
    stack.callback(thread.join, 5)
    stack.callback(stop.set)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(rounds: int, per_scraper: int) -> dict[str, list[float]]:
    process, port = _start_server()
    out: dict[str, list[float]] = {"quiet": [], "hostile": [], "ratios": []}
    try:
        _scrape_round(port, 2)  # warm-up
        for i in range(rounds):
            order = ("quiet", "hostile") if i % 2 == 0 else ("hostile", "quiet")
            p99 = {}
            for case in order:
                with ExitStack() as stack:
                    if case == "hostile":
                        _hostile(port, stack)
                    latencies = _scrape_round(port, per_scraper)
                out[case].extend(latencies)
                p99[case] = _p(latencies, 0.99)
            out["ratios"].append(p99["hostile"] / p99["quiet"])
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=30)
    return out


def run(quick: bool = False) -> list[Row]:
    data = measure(rounds=4 if quick else 10, per_scraper=10 if quick else 20)
    quiet, hostile, ratios = data["quiet"], data["hostile"], sorted(data["ratios"])
    ratio = _p(hostile, 0.99) / _p(quiet, 0.99)
    name = "scrape latency, hostile clients"
    return [
        Row(name, f"p99, {SCRAPERS} scrapers alone", _p(quiet, 0.99) * 1e3, "ms"),
        Row(name, f"p99, with {IDLE} idle + {SLOW_LORIS} slow-loris", _p(hostile, 0.99) * 1e3,
            "ms"),
        Row(name, f"p99 ratio (per-round spread {ratios[0]:.2f}-{ratios[-1]:.2f})", ratio, "x",
            "<= 2x", ratio <= 2.0),
        Row(name, "slowest scrape with hostile clients", max(hostile) * 1e3, "ms", "< 1000 ms",
            max(hostile) < 1.0),
    ]


if __name__ == "__main__":
    from benchmarks.common import render

    print(render(run(quick="--quick" in sys.argv)))
