"""prometheus-client's multiprocess mode, made to survive restarts and bad files.

With ``PROMETHEUS_MULTIPROC_DIR`` every process writes its values to ``*.db`` files
there and a scrape merges them. Two things go wrong with the library alone:

* Nothing marks a process dead, so a restarted engine's ``live*`` gauges add to those
  of the process it replaced. Here a process marks itself dead when its sink closes
  (the engine's shutdown hook) and at exit, and every scrape and every new sink
  clears the gauge files of processes that no longer exist (``kill -9`` runs no hook).
* One empty or truncated ``*.db`` file makes every merge raise (``struct.error``), so
  every scrape is an HTTP 500. Here such a file is left out of the page, logged once,
  and counted in ``kvmetrics_scrape_errors_total{reason="unreadable_multiprocess_file"}``.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import logging
import os
from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

log = logging.getLogger("kvmetrics.multiprocess")

#: Gauge files whose values only count while their process lives.
_LIVE_PREFIX = "gauge_live"


def _pid_of(path: str) -> int | None:
    """The writer's pid from a ``gauge_<mode>_<pid>.db`` name, or None."""
    stem = os.path.basename(path)[:-3]
    tail = stem.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def reap_dead_processes(directory: str) -> list[int]:
    """Mark dead every process that left live-gauge files and no longer runs."""
    dead = set()
    for path in glob.glob(os.path.join(directory, f"{_LIVE_PREFIX}*_*.db")):
        pid = _pid_of(path)
        if pid is not None and pid != os.getpid() and not _alive(pid):
            dead.add(pid)
    for pid in sorted(dead):
        with contextlib.suppress(OSError):  # another process reaped it first
            mark_process_dead(pid, directory)
    return sorted(dead)


class ProcessLifetime:
    """Marks this process dead in ``directory`` once: on :meth:`close` or at exit."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.pid = os.getpid()
        self._closed = False
        reap_dead_processes(directory)
        atexit.register(self.close)

    def close(self) -> None:
        if self._closed or os.getpid() != self.pid:  # a forked child is not us
            return
        self._closed = True
        try:
            mark_process_dead(self.pid, self.directory)
        except OSError:
            log.warning("kvmetrics: could not mark pid %d dead in %s", self.pid, self.directory)


class TolerantMultiProcessCollector(Collector):
    """Every process's values from ``directory``, leaving out files that cannot be read.

    ``on_bad_file`` is called once per unreadable file per scrape, before the page is
    merged (so a counter it increments in this process shows on that same page).
    """

    def __init__(self, directory: str, on_bad_file: Callable[[str], None]) -> None:
        self.directory = directory
        self.on_bad_file = on_bad_file
        self._logged: set[str] = set()

    def collect(self) -> Iterator[Metric]:
        reap_dead_processes(self.directory)
        pattern = os.path.join(self.directory, "*.db")
        files = glob.glob(pattern)
        try:
            return iter(MultiProcessCollector.merge(files, accumulate=True))
        except Exception:
            pass  # find the bad file(s) one by one below
        bad = [path for path in files if self._state(path) == "bad"]
        for path in bad:
            self.on_bad_file(path)
        # Globbed again: counting may have created this process's own counter file.
        good = [path for path in glob.glob(pattern) if path not in bad]
        try:
            return iter(MultiProcessCollector.merge(good, accumulate=True))
        except Exception:  # a file went bad or away meanwhile: leave it out uncounted
            return iter(MultiProcessCollector.merge(
                [path for path in good if self._state(path) == "ok"], accumulate=True))

    def _state(self, path: str) -> str:
        """``ok``, ``gone`` (removed since the glob: a process marked dead) or ``bad``."""
        try:
            MultiProcessCollector.merge([path], accumulate=True)
        except FileNotFoundError:
            return "gone"
        except Exception as e:
            if path not in self._logged:
                self._logged.add(path)
                log.error("kvmetrics: skipping unreadable multiprocess file %s (%s: %s)",
                          path, type(e).__name__, " ".join(str(e).split())[:200])
            return "bad"
        return "ok"
