"""The engine and its scraper under every flood kind, with ``serve=process``.

The reference engine records into a multiprocess sink in this process while
supervised exporter processes (:mod:`kvmetrics.exporters.process`; one plain, one
with mutual TLS, both serving the same files) answer the hostile clients of
:mod:`benchmarks.floods`, one kind at a time, and one legitimate scraper (1/s,
10 s timeout). Per kind, rounds alternate flood on / flood off (which one first
alternates too); in each phase the engine runs the same workload back to back for
``phase_s`` seconds. What a flood can cost the engine is CPU time of the engine
thread (no thread of this process touches a connection), so the verdict is the
median per-round ratio of that thread's CPU seconds per workload run, flood / quiet,
with its spread; the wall-time ratio is reported too (on a shared machine other load
widens it). The scraper's scrapes that start during flood phases are counted. The
100k-series kind is a valid multiprocess file of 100,000 series
moved into the served directory (flood on) and out again (off): every scrape's
collection reads it. The exporter's resident memory is sampled after every flood
phase. Run with ``python -m benchmarks.bench_endpoint --serve-process``; it switches
this process's prometheus-client to multiprocess files, so it runs alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import Row
from benchmarks.floods import KINDS, SCRAPE_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]
MPFILE_SERIES = 100_000
#: Every kind, in the order they run.
ALL_KINDS = (*KINDS, "mpfile")
TARGET_RATIO = 1.02
TARGET_SUCCESS = 0.95
ROUNDS = 6
PHASE_S = 2.5


@dataclass
class KindResult:
    cpu_ratios: list[float] = field(default_factory=list)
    wall_ratios: list[float] = field(default_factory=list)
    #: (succeeded, seconds) of each scrape taken while the flood was on.
    scrapes: list[tuple[bool, float]] = field(default_factory=list)
    exporter_rss_mb: float = 0.0


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env


def _client(kind: str, port: int, tls_files: list[str]) -> subprocess.Popen[str]:
    """A flood (at the lowest CPU priority: an attacker's CPU is not the engine's host's,
    here it shares the same cores) or the scraper."""
    hostile = kind != "scraper"
    return subprocess.Popen([sys.executable, "-m", "benchmarks.floods", kind, str(port),
                             *tls_files], cwd=ROOT, env=_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: os.nice(19)) if hostile else None)


def _tell(process: subprocess.Popen[str], line: str) -> None:
    assert process.stdin is not None
    process.stdin.write(line + "\n")
    process.stdin.flush()


def _end(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.close()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:  # daemon threads mid-request: it is done anyway
        process.kill()
        process.wait()


def _report(scraper: subprocess.Popen[str]) -> list[tuple[bool, float, float]]:
    _tell(scraper, "report")
    assert scraper.stdout is not None
    return [(bool(ok), float(took), float(started))
            for ok, took, started in json.loads(scraper.stdout.readline())]


def _scrapes_in(scraper: subprocess.Popen[str], windows: list[tuple[float, float]]
                ) -> list[tuple[bool, float]]:
    """The scraper's scrapes that started inside one of ``windows`` (flood phases), once
    the last of them has finished (one may outlast its phase: a slow page)."""
    done: list[tuple[bool, float, float]] = []
    deadline = time.monotonic() + 2 * SCRAPE_TIMEOUT_S
    while time.monotonic() < deadline:
        done += _report(scraper)
        if any(started > windows[-1][1] for _, _, started in done):
            break
        time.sleep(0.5)
    return [(ok, took) for ok, took, started in done
            if any(t0 <= started <= t1 for t0, t1 in windows)]


def _series_file(folder: Path) -> Path:
    """A valid counter file of MPFILE_SERIES series, as a worker process writes it."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    path = folder / "counter_4000000.db"
    values = MmapedDict(str(path))
    name = "kvmetrics_bench_flood_total"
    for i in range(MPFILE_SERIES):
        values.write_value(mmap_key(name, name, ["series"], [str(i)], "flood"), 1.0, 0.0)
    values.close()
    return path


def _phase(sink: object, items: list[object], phase_s: float) -> tuple[float, float]:
    """Wall and engine-thread CPU seconds per workload run, runs back to back."""
    from benchmarks.bench_endpoint import _engine_run

    wall = cpu = 0.0
    runs = 0
    started = time.monotonic()
    while runs == 0 or time.monotonic() - started < phase_s:
        w, c = _engine_run(sink, items)
        wall, cpu, runs = wall + w, cpu + c, runs + 1
    return wall / runs, cpu / runs


def measure(rounds: int, phase_s: float, kinds: tuple[str, ...] = ALL_KINDS
            ) -> tuple[dict[str, KindResult], float]:
    """Per kind its result; and the exporter's resident memory before any flood."""
    from benchmarks.bench_endpoint import _engine_run, _rss_mb
    from benchmarks.tls import make_tls_material
    from kvmetrics.exporters.process import ChildSettings, ServeProcess, start_serve_process
    from kvmetrics.exporters.prometheus import PrometheusSink
    from kvmetrics.lab import synthetic

    results = {kind: KindResult() for kind in kinds}
    with tempfile.TemporaryDirectory() as folder:
        tls = make_tls_material(Path(folder) / "tls")
        tls_files = [str(tls.ca_cert), str(tls.client_cert), str(tls.client_key)]
        plain = start_serve_process(("127.0.0.1", 0), None)
        secure = ServeProcess(ChildSettings(plain.settings.directory, "127.0.0.1", 0,
                                            str(tls.server_cert), str(tls.server_key),
                                            str(tls.ca_cert)))
        try:
            secure.start()
            sink = PrometheusSink()
            items = synthetic.generate("mixed", 120, seed=1)
            _engine_run(sink, items)  # warm-up
            idle_rss = _rss_mb(plain.pid or 0)
            parked = _series_file(Path(folder)) if "mpfile" in kinds else None
            for kind in kinds:
                child = secure if kind == "tls" else plain
                files = tls_files if kind == "tls" else []
                scraper = _client("scraper", child.settings.port, files)
                hostile = None if kind == "mpfile" else _client(kind, child.settings.port,
                                                                 files)
                served = Path(plain.settings.directory) / "counter_4000000.db"
                windows: list[tuple[float, float]] = []
                try:
                    for i in range(rounds):
                        timed: dict[str, tuple[float, float]] = {}
                        for case in (("quiet", "flood") if i % 2 == 0 else ("flood", "quiet")):
                            on = case == "flood"
                            if hostile is not None:
                                _tell(hostile, "1" if on else "0")
                            elif parked is not None and (parked if on else served).exists():
                                os.rename(*((parked, served) if on else (served, parked)))
                            time.sleep(0.3)  # the clients start (or finish their requests)
                            started = time.time()
                            timed[case] = _phase(sink, items, phase_s)
                            if on:
                                windows.append((started, time.time()))
                                results[kind].exporter_rss_mb = max(
                                    results[kind].exporter_rss_mb, _rss_mb(child.pid or 0))
                        results[kind].wall_ratios.append(timed["flood"][0] / timed["quiet"][0])
                        results[kind].cpu_ratios.append(timed["flood"][1] / timed["quiet"][1])
                    if hostile is not None:
                        _tell(hostile, "0")
                    results[kind].scrapes = _scrapes_in(scraper, windows)
                finally:
                    if hostile is not None:
                        _end(hostile)
                    _end(scraper)
                    if parked is not None and served.exists():
                        os.rename(served, parked)
            sink.close()
        finally:
            secure.stop()
            plain.stop()
    return results, idle_rss


def _spread(values: list[float]) -> tuple[float, str]:
    ordered = sorted(values)
    return ordered[len(ordered) // 2], f"{ordered[0]:.3f}-{ordered[-1]:.3f}"


def run(quick: bool = False) -> list[Row]:
    results, idle_rss = measure(rounds=2 if quick else ROUNDS, phase_s=1.0 if quick else PHASE_S)
    rows = [Row("exporter process", "RSS idle, after one scrape", idle_rss, "MB")]
    for kind, result in results.items():
        name = f"serve=process, flood: {kind}"
        cpu, cpu_spread = _spread(result.cpu_ratios)
        wall, wall_spread = _spread(result.wall_ratios)
        ok = sum(1 for good, _ in result.scrapes if good)
        total = max(1, len(result.scrapes))
        took = sorted(t for _, t in result.scrapes) or [0.0]
        p99 = took[min(len(took) - 1, int(0.99 * len(took)))]
        rows += [
            Row(name, f"engine thread CPU per run, median ratio flood / quiet "
                      f"(spread {cpu_spread})", cpu, "x", f"<= {TARGET_RATIO}x",
                cpu <= TARGET_RATIO),
            Row(name, f"wall per run, median ratio flood / quiet (spread {wall_spread})",
                wall, "x"),
            Row(name, f"scraper 1/s: scrapes that succeeded ({ok}/{len(result.scrapes)})",
                ok / total * 100, "%", f">= {TARGET_SUCCESS:.0%}", ok / total >= TARGET_SUCCESS),
            Row(name, f"scraper 1/s: p99 scrape time ({len(result.scrapes)} scrapes)",
                p99 * 1e3, "ms"),
            Row(name, "exporter process RSS, highest after a flood phase",
                result.exporter_rss_mb, "MB"),
        ]
    return rows
