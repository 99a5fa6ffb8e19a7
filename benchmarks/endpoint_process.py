"""The scrape flood of :mod:`benchmarks.bench_endpoint` against ``serve=process``.

The reference engine records into a multiprocess sink in this process while a
supervised exporter process (:mod:`kvmetrics.exporters.process`) serves its files to
8 keep-alive clients asking for pages back to back; the same engine with the clients
paused, interleaved round by round. What the flood can cost the engine is CPU time
of the engine thread (no thread of this process touches a connection), so the
verdict is the median per-round ratio of that thread's CPU seconds, flood / quiet,
with its spread; the wall-time ratio is reported too (other load on a shared machine
widens it). Run with ``python -m benchmarks.bench_endpoint --serve-process``; it
switches this process's prometheus-client to multiprocess files, so it runs alone.
"""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks.common import Row


def measure(rounds: int, requests: int) -> dict[str, list[float]]:
    """Per-round ratios, flood / quiet, of the engine thread's CPU and wall time."""
    from benchmarks.bench_endpoint import _FLOOD, FLOOD_CLIENTS, _engine_run
    from kvmetrics.exporters.process import start_serve_process
    from kvmetrics.exporters.prometheus import PrometheusSink
    from kvmetrics.lab import synthetic

    child = start_serve_process(("127.0.0.1", 0), None)
    flood = None
    try:
        sink = PrometheusSink()
        items = synthetic.generate("mixed", requests, seed=1)
        flood = subprocess.Popen([sys.executable, "-c", _FLOOD, str(child.settings.port),
                                  str(FLOOD_CLIENTS)], stdin=subprocess.PIPE, text=True)
        assert flood.stdin is not None
        runs: dict[str, list[tuple[float, float]]] = {"quiet": [], "flood": []}
        _engine_run(sink, items)  # warm-up
        for i in range(rounds):
            for case in (("quiet", "flood") if i % 2 == 0 else ("flood", "quiet")):
                flood.stdin.write("1\n" if case == "flood" else "0\n")
                flood.stdin.flush()
                time.sleep(0.3)  # the clients start (or finish their last request)
                runs[case].append(_engine_run(sink, items))
        sink.close()
    finally:
        if flood is not None and flood.stdin is not None:
            flood.stdin.close()
            flood.wait(timeout=30)
        child.stop()
    pairs = list(zip(runs["flood"], runs["quiet"], strict=True))
    return {"cpu": sorted(f[1] / q[1] for f, q in pairs),
            "wall": sorted(f[0] / q[0] for f, q in pairs)}


def run(quick: bool = False) -> list[Row]:
    from benchmarks.bench_endpoint import FLOOD_CLIENTS

    ratios = measure(rounds=4 if quick else 12, requests=60 if quick else 120)
    name = f"engine under a {FLOOD_CLIENTS}-client scrape flood, serve=process"
    cpu, wall = ratios["cpu"], ratios["wall"]
    return [
        Row(name, f"engine thread CPU, median ratio flood / quiet (spread "
                  f"{cpu[0]:.2f}-{cpu[-1]:.2f})", cpu[len(cpu) // 2], "x"),
        Row(name, f"wall, median ratio flood / quiet (spread {wall[0]:.2f}-{wall[-1]:.2f})",
            wall[len(wall) // 2], "x"),
    ]
