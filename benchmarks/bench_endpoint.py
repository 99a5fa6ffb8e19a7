"""The scrape endpoint under hostile clients, three ways.

- **Idle sockets:** p99 latency of 10 concurrent scrapers (a new connection per
  scrape, the worst case for the endpoint) while 1,500 idle and 50 slow-loris
  connections are held open, against the same scrapers alone, interleaved round by
  round (timed once they are open: the first scrape after the burst of connects,
  not timed, waits for the endpoint to accept them all). The endpoint runs in a
  process of its own serving one engine's series after a real run, its request-rate
  bound off (so that what is timed is connection handling, not the bound's queue).
- **Scrape flood:** wall time of the reference engine (scheduler, executor, metrics
  pipeline into the served sink) in this process while its in-engine endpoint
  serves 8 keep-alive clients asking for pages back to back from another process, against
  the same engine with the clients paused; interleaved rounds, median of the
  per-round ratios. The flood's cost to the engine is the GIL the endpoint's threads
  hold, so the verdict is taken from CPU time, which other load on the machine
  changes far less than wall time (if anything it makes it larger): the endpoint
  threads' CPU seconds per wall second of the flood (their GIL share), and
  1 / (1 - share), the wall-time ratio of an engine that needs the GIL all the
  time. The measured wall-time ratio is reported too; on a busy shared machine its
  spread is far wider than the 5% it would be judged against. Done with the default
  limits and with the page cache and request rate off (the endpoint before issue 28).
- **Memory:** the resident memory of an endpoint process serving mutual TLS, idle
  and with 1,000 connections that each sent a ClientHello and stall; the same for
  plain HTTP with 1,000 silent connections.

The keep-alive flood is :mod:`benchmarks.floods`' (8 clients). ``python -m
benchmarks.bench_endpoint`` prints the details; with ``--serve-process`` it runs every
flood kind of :mod:`benchmarks.floods` against exporter processes instead, with a
legitimate scraper (:mod:`benchmarks.endpoint_process`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import resource
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks.common import Row
from benchmarks.floods import KEEPALIVE_CLIENTS

SCRAPERS = 10
IDLE = 1500
SLOW_LORIS = 50
FLOOD_CLIENTS = KEEPALIVE_CLIENTS
PENDING_TLS = 1000
ROOT = Path(__file__).resolve().parents[1]

_SERVER = """
import json, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
from benchmarks.bench_exporter import _populated_registry
from kvmetrics.exporters.http import ServerLimits
from kvmetrics.exporters.prometheus import TLSOptions, serve
limits, tls = json.loads(sys.argv[1]), json.loads(sys.argv[2])
server = serve(_populated_registry(1), port=0, limits=ServerLimits(**limits),
               tls=TLSOptions(**tls) if tls else None)
print(server.port, flush=True)
sys.stdin.read()
server.stop()
"""

def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env


def _start_server(limits: dict[str, float] | None = None,
                  tls: dict[str, object] | None = None) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVER, json.dumps(limits or {}), json.dumps(tls or {})],
        cwd=ROOT, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def _stop(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.close()
    process.wait(timeout=30)


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- idle sockets ----------------------------------------------------------------------


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


def measure_idle(rounds: int, per_scraper: int) -> dict[str, list[float]]:
    _raise_fd_limit()
    process, port = _start_server({"max_requests_per_s": 0, "backlog": 2048})
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
                        _scrape(port)  # once the endpoint has accepted them all
                    latencies = _scrape_round(port, per_scraper)
                out[case].extend(latencies)
                p99[case] = _p(latencies, 0.99)
            out["ratios"].append(p99["hostile"] / p99["quiet"])
    finally:
        _stop(process)
    return out


# -- scrape flood ----------------------------------------------------------------------


def _engine_run(sink: object, items: list[object]) -> tuple[float, float]:
    """Wall and CPU seconds of one reference-engine run recording into ``sink``."""
    from kvmetrics.lab.engine.executor import SimulatedExecutor
    from kvmetrics.lab.engine.loop import EngineLoop
    from kvmetrics.lab.engine.scheduler import Scheduler, SchedulerConfig
    from kvmetrics.lab.engine_registry import make_request
    from kvmetrics.metrics.pipeline import MetricsPipeline

    t0, c0 = time.perf_counter(), time.thread_time()
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=256))
    pipeline = MetricsPipeline([sink], engine="0")  # type: ignore[list-item]
    for item in items:
        sched.add_request(make_request(item, 8))  # type: ignore[arg-type]
    loop = EngineLoop(sched, SimulatedExecutor())
    while loop.busy():
        loop.step()
        for events in sched.drain_events():
            pipeline.record(events)
    return time.perf_counter() - t0, time.thread_time() - c0


def _endpoint_cpu_s() -> float:
    """CPU seconds used so far by this process's endpoint threads (loop and renderers):
    the GIL time they took from the engine, whatever else the machine runs. From
    ``/proc/self/task/TID/schedstat`` (nanoseconds on the CPU)."""
    ns = 0
    for thread in threading.enumerate():
        if thread.name.startswith(("kvmetrics-http", "kvmetrics-render")) and thread.native_id:
            with contextlib.suppress(OSError):
                path = Path(f"/proc/self/task/{thread.native_id}/schedstat")
                ns += int(path.read_text().split()[0])
    return ns / 1e9


def measure_flood(rounds: int, requests: int, **limits: float) -> dict[str, object]:
    """Engine wall time with the flood on and off, interleaved; the endpoint in-process."""
    from prometheus_client import CollectorRegistry

    from kvmetrics.exporters.http import ServerLimits
    from kvmetrics.exporters.prometheus import PrometheusSink, serve
    from kvmetrics.lab import synthetic

    sink = PrometheusSink(CollectorRegistry())
    items = synthetic.generate("mixed", requests, seed=1)
    server = serve(sink.serving_registry(), port=0, limits=ServerLimits(**limits))
    flood = subprocess.Popen([sys.executable, "-m", "benchmarks.floods", "keepalive",
                              str(server.port)], cwd=ROOT, env=_env(), stdin=subprocess.PIPE,
                             text=True)
    assert flood.stdin is not None
    times: dict[str, list[float]] = {"quiet": [], "flood": []}
    served = 0
    endpoint_cpu = 0.0
    try:
        _engine_run(sink, items)  # warm-up
        for i in range(rounds):
            for case in (("quiet", "flood") if i % 2 == 0 else ("flood", "quiet")):
                flood.stdin.write("1\n" if case == "flood" else "0\n")
                flood.stdin.flush()
                time.sleep(0.3)  # the clients start (or finish their last request)
                before, cpu_before = server.endpoint.stats.served, _endpoint_cpu_s()
                times[case].append(_engine_run(sink, items)[0])
                if case == "flood":
                    served += server.endpoint.stats.served - before
                    endpoint_cpu += _endpoint_cpu_s() - cpu_before
    finally:
        flood.stdin.close()
        flood.wait(timeout=30)
        server.stop()
    ratios = sorted(f / q for f, q in zip(times["flood"], times["quiet"], strict=True))
    flooded = sum(times["flood"])
    return {"times": times, "ratios": ratios, "pages_per_s": served / flooded,
            "endpoint_share": endpoint_cpu / flooded,
            "gil_bound_ratio": 1 / (1 - endpoint_cpu / flooded)}


# -- TLS memory ------------------------------------------------------------------------


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _client_hello() -> bytes:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with contextlib.suppress(ssl.SSLWantReadError):
        client.do_handshake()
    return outgoing.read()


def measure_memory(pending: int, tls: bool) -> dict[str, float]:
    """Endpoint RSS idle, with ``pending`` connections open (TLS: each sent a
    ClientHello and stalls; plain: silent), and after they closed."""
    from benchmarks.tls import make_tls_material

    _raise_fd_limit()
    with tempfile.TemporaryDirectory() as folder:
        material = make_tls_material(Path(folder)) if tls else None
        options = {} if material is None else {
            "certfile": str(material.server_cert), "keyfile": str(material.server_key),
            "client_cafile": str(material.ca_cert), "client_auth_required": True}
        process, port = _start_server(tls=options)
        try:
            def scrape() -> None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10) \
                    if material is None else http.client.HTTPSConnection(
                        "127.0.0.1", port, timeout=10, context=material.client_context())
                conn.request("GET", "/metrics")
                assert conn.getresponse().status == 200
                conn.close()

            scrape()
            time.sleep(0.5)
            out = {"idle": _rss_mb(process.pid)}
            hello = _client_hello() if tls else b""
            with ExitStack() as stack:
                for _ in range(pending):
                    s = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
                    s.sendall(hello)
                time.sleep(2.0)  # the endpoint reads every ClientHello it will read
                out["pending"] = _rss_mb(process.pid)
                scrape()  # still answered
            time.sleep(1.0)
            out["after"] = _rss_mb(process.pid)
        finally:
            _stop(process)
    return out


def run(quick: bool = False) -> list[Row]:
    rows = []
    data = measure_idle(rounds=4 if quick else 10, per_scraper=10 if quick else 20)
    quiet, hostile, ratios = data["quiet"], data["hostile"], sorted(data["ratios"])
    ratio = _p(hostile, 0.99) / _p(quiet, 0.99)
    name = "scrape latency, hostile clients"
    rows += [
        Row(name, f"p99, {SCRAPERS} scrapers alone", _p(quiet, 0.99) * 1e3, "ms"),
        Row(name, f"p99, with {IDLE} idle + {SLOW_LORIS} slow-loris", _p(hostile, 0.99) * 1e3,
            "ms"),
        Row(name, f"p99 ratio (per-round spread {ratios[0]:.2f}-{ratios[-1]:.2f})", ratio, "x",
            "<= 2x", ratio <= 2.0),
        Row(name, "slowest scrape with hostile clients", max(hostile) * 1e3, "ms", "< 1000 ms",
            max(hostile) < 1.0),
    ]
    name = f"engine under a {FLOOD_CLIENTS}-client scrape flood"
    for label, limits in (("default limits", {}),
                          ("cache and rate bound off", {"page_max_age_s": 0,
                                                        "max_requests_per_s": 0})):
        flood = measure_flood(rounds=6 if quick else 12, requests=60 if quick else 120,
                              **limits)
        r = flood["ratios"]
        median = r[len(r) // 2]
        bounded = not limits
        rows += [
            Row(name, f"{label}: answers per second (pages and 429s)", flood["pages_per_s"],
                "/s"),
            Row(name, f"{label}: endpoint CPU per answer",
                flood["endpoint_share"] / max(flood["pages_per_s"], 1e-9) * 1e6, "us"),
            Row(name, f"{label}: endpoint threads' CPU per engine second",
                flood["endpoint_share"] * 100, "%"),
            Row(name, f"{label}: GIL-bound ratio 1 / (1 - endpoint CPU share)",
                flood["gil_bound_ratio"], "x", "<= 1.05x" if bounded else "",
                flood["gil_bound_ratio"] <= 1.05 if bounded else None),
            Row(name, f"{label}: wall, median ratio flood / quiet (spread {r[0]:.2f}-{r[-1]:.2f})",
                median, "x"),
        ]
    name = "endpoint memory (RSS)"
    for label, tls in (("TLS", True), ("plain", False)):
        mem = measure_memory(PENDING_TLS, tls)
        grown = mem["pending"] - mem["idle"]
        what = "pending handshakes" if tls else "idle connections"
        rows += [
            Row(name, f"{label}: idle, after one scrape", mem["idle"], "MB"),
            Row(name, f"{label}: {PENDING_TLS} {what}, above idle", grown, "MB",
                "<= 50 MB" if tls else "", grown <= 50 if tls else None),
            Row(name, f"{label}: after they closed, above idle", mem["after"] - mem["idle"],
                "MB"),
        ]
    return rows


if __name__ == "__main__":
    from benchmarks.common import render

    if "--serve-process" in sys.argv:  # the flood against serve=process, alone
        from benchmarks.endpoint_process import run as run_serve_process

        print(render(run_serve_process(quick="--quick" in sys.argv,
                                       pin="--no-pin" not in sys.argv)))
    else:
        print(render(run(quick="--quick" in sys.argv)))
