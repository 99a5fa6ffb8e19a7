"""Multiprocess scrapes with thousands of dead processes' files (issue 28, case 13).

One real engine run (``kvmetrics run``, 20 requests) writes its files; they are copied
as the leftovers of 2,000 processes that no longer exist (pids nobody holds). Timed:
prometheus-client's merge of every file (what each scrape cost before, and still costs
vLLM's own ``/metrics``), kvmetrics' collector on its first scrape and on later ones,
and both again after one empty ``*.db`` file is added (before, every file was then
re-read one by one to find the bad one). And the writer's path: one update and one new
series, the library's ``mmap`` store against kvmetrics' deferred write. ``python -m
benchmarks.bench_multiprocess`` (``--writer`` for the writer's rows alone).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.multiprocess import MultiProcessCollector

from benchmarks.common import Row, best_time
from kvmetrics.exporters.mpfiles import ScrapeBudget
from kvmetrics.exporters.multiprocess import TolerantMultiProcessCollector

PROCESSES = 2000


def _engine_files(directory: Path) -> list[Path]:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root),
                                                       os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-m", "kvmetrics", "run", "--max-requests", "20",
                    "--verify", "off", "--json"], cwd=root, env=env, check=True,
                   stdout=subprocess.DEVNULL, timeout=600)
    return sorted(directory.glob("*.db"))


def _dead_pids(n: int) -> list[int]:
    pids = []
    for pid in range(4_194_303, 0, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            pids.append(pid)
            if len(pids) == n:
                break
        except OSError:
            pass
    return pids


def _old_merge(files: list[str]) -> None:
    """kvmetrics before: the library's merge, and on failure each file on its own."""
    try:
        MultiProcessCollector.merge(files, accumulate=True)
        return
    except Exception:
        pass
    good = []
    for f in files:
        try:
            MultiProcessCollector.merge([f], accumulate=True)
            good.append(f)
        except Exception:
            pass
    MultiProcessCollector.merge(good, accumulate=True)


def run(quick: bool = False) -> list[Row]:
    n = 200 if quick else PROCESSES
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        made = Path(scratch, "made")
        made.mkdir()
        sources = _engine_files(made)
        directory = Path(scratch, "multiproc")
        directory.mkdir()
        for pid in _dead_pids(n):
            for source in sources:
                shutil.copyfile(source, directory / f"{source.name.split('_')[0]}_{pid}.db")
        files = sorted(str(p) for p in directory.glob("*.db"))
        # The whole merge in one scrape (the default budget spreads 2,000 processes'
        # files over a few scrapes): what is timed is the merge, not the budget.
        collector = TolerantMultiProcessCollector(
            str(directory), lambda path: None,
            budget=ScrapeBudget(max_bytes=1 << 40, max_seconds=float("inf")))
        name = f"multiprocess, {n} dead processes"
        repeat = 2 if quick else 3
        rows.append(Row(name, "prometheus-client merge per scrape",
                        best_time(lambda: MultiProcessCollector.merge(files), repeat) * 1e3,
                        "ms"))
        rows.append(Row(name, "kvmetrics first scrape",
                        best_time(lambda: list(collector.collect()), 1) * 1e3, "ms"))
        rows.append(Row(name, "kvmetrics later scrapes",
                        best_time(lambda: list(collector.collect()), repeat) * 1e3, "ms"))
        (directory / "counter_1.db").write_bytes(b"")  # pid 1 lives: read on every scrape
        files.append(str(directory / "counter_1.db"))
        rows.append(Row(name, "+1 empty file: kvmetrics before (each file re-read)",
                        best_time(lambda: _old_merge(files), 1) * 1e3, "ms"))
        rows.append(Row(name, "+1 empty file: kvmetrics later scrapes",
                        best_time(lambda: list(collector.collect()), repeat) * 1e3, "ms"))
    return rows


def _alternating(name: str, ours_label: str, library_time: Callable[[], float],
                 ours_time: Callable[[], float], rounds: int) -> list[Row]:
    """Rows for one cost timed alternately in rounds: the best of each, and the ratio
    per round (ours / the library's), median and spread."""
    ratios, library_us, ours_us = [], [], []
    for i in range(rounds):
        pair = [(library_time, library_us), (ours_time, ours_us)]
        for timed, times in (pair if i % 2 else pair[::-1]):
            times.append(timed() * 1e6)
        ratios.append(ours_us[-1] / library_us[-1])
    ratios.sort()
    return [Row(name, "prometheus-client mmap store", min(library_us), "us"),
            Row(name, ours_label, min(ours_us), "us"),
            Row(name, f"ratio, median (spread {ratios[0]:.2f}-{ratios[-1]:.2f})",
                ratios[len(ratios) // 2], "x")]


def _round_time(f: Any, key: str, n: int) -> float:
    """Seconds one flush of ``n`` updated keys takes (the thread's work per round, off
    the engine's thread), the median of 200. The watcher's own rounds must be off
    (:func:`writer_rows` sets its interval out of reach), or a timing could find the
    keys already written and time an empty flush."""
    keys = [f"{key}-round-{i}" for i in range(n)]
    for k in keys:
        f.write_value(k, 1.0, 0.0)  # a new series is written at once, not in a round
    f.flush()
    times = []
    for _ in range(200):
        for k in keys:
            f.write_value(k, 2.0, 0.0)
        assert len(f._dirty) == n, "the watcher flushed during the timing"
        start = time.perf_counter()
        f.flush()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def writer_rows(quick: bool = False) -> list[Row]:
    """One update's cost on the writer's path, prometheus-client's ``mmap`` store against
    kvmetrics' :class:`~kvmetrics.exporters.mmap_space.ValueFile` (a dict store and a
    dirty mark; the thread's write is timed on its own, as a round), and the
    cost of a new series (a key not yet in the file: written at once, its space
    allocated first), each timed alternately in rounds."""
    from prometheus_client.mmap_dict import MmapedDict

    from kvmetrics.exporters import value_watcher
    from kvmetrics.exporters.mmap_space import ValueFile

    # The watcher's thread starts with the first ValueFile and sleeps this long
    # between rounds: out of reach, so that only the timed flushes write.
    value_watcher.FLUSH_INTERVAL_S = 1e6

    key = '["kvmetrics_preemptions_total", "kvmetrics_preemptions_total", ' \
          '{"engine": "0", "model_name": "m"}, "h"]'
    calls = 20_000 if quick else 100_000
    rounds = 5 if quick else 9
    new_keys = 500 if quick else 2000
    with tempfile.TemporaryDirectory() as scratch:
        library = MmapedDict(os.path.join(scratch, "counter_1.db"))
        ours = ValueFile(os.path.join(scratch, "counter_2.db"))
        try:
            rows = _alternating(
                "multiprocess writer, one update", "kvmetrics deferred write",
                lambda: best_time(lambda: library.write_value(key, 2.0, 0.0), 1, calls),
                lambda: best_time(lambda: ours.write_value(key, 2.0, 0.0), 1, calls),
                rounds)
            rows += [Row("multiprocess writer, the thread's round", f"{n} updated keys, median",
                         _round_time(ours, key, n) * 1e6, "us") for n in (1, 100)]
        finally:
            library.close()
            ours.close()

        def new_series(file_class: Callable[[str], Any]) -> float:
            """Mean seconds to add one series to a fresh file (growth included)."""
            path = os.path.join(scratch, f"counter_{os.getpid()}.db")
            f = file_class(path)
            start = time.perf_counter()
            for i in range(new_keys):
                f.write_value(f"{key}-{i}", 1.0, 0.0)
            spent = time.perf_counter() - start
            f.close()
            os.unlink(path)
            return spent / new_keys

        rows += _alternating("multiprocess writer, one new series",
                             "kvmetrics write at once", lambda: new_series(MmapedDict),
                             lambda: new_series(ValueFile), rounds)
    return rows


if __name__ == "__main__":
    from benchmarks.common import render

    quick = "--quick" in sys.argv
    print(render(writer_rows(quick) + ([] if "--writer" in sys.argv else run(quick))))
