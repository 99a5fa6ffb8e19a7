"""prometheus-client's multiprocess mode, made to survive restarts, bad files and outages.

With ``PROMETHEUS_MULTIPROC_DIR`` every process writes its values to ``*.db`` files
there and a scrape merges them. What goes wrong with the library alone, and what is
done here:

* Nothing marks a process dead, so a restarted engine's ``live*`` gauges add to those
  of the process it replaced. Here a process marks itself dead when its sink closes
  (the engine's shutdown hook) and at exit, and every scrape and every new sink
  clears the gauge files of processes that no longer exist (``kill -9`` runs no hook).
* One bad ``*.db`` file (empty, truncated, a header claiming 2 GB, a name whose pid
  overflows ``os.kill``, a FIFO) makes every merge raise, hang or eat gigabytes. Here
  each file is read with bounds (:mod:`kvmetrics.exporters.mpfiles`); a bad one is left
  out of the page, logged once, and counted in
  ``kvmetrics_scrape_errors_total{reason="unreadable_multiprocess_file"}``.
* Every scrape re-reads every file, those of long-dead processes too (2,000 of them:
  about a second a scrape). Here a dead process's file is read once and merged into a
  kept sum; it is read again only if its inode, size or mtime changes.
* A directory that disappears gives an empty page with status 200. Here the scrape
  fails (HTTP 503, so Prometheus shows ``up == 0``) and the cause is logged once.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import mark_process_dead
from prometheus_client.registry import Collector

from kvmetrics.exporters.mpfiles import (
    BadFile,
    Entry,
    FileName,
    Key,
    Merged,
    parse_entries,
    parse_name,
    read_bytes,
)
from kvmetrics.exporters.pages import PageUnavailable
from kvmetrics.metrics.logs import get_logger

log = get_logger("kvmetrics.multiprocess")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process; anything else: not known dead
        return True
    return True


def _db_files(directory: str) -> list[str]:
    """The ``*.db`` names in ``directory`` (as the library's glob finds them); OSError
    when the directory cannot be listed."""
    return sorted(n for n in os.listdir(directory) if n.endswith(".db") and n[0] != ".")


def reap_dead_processes(directory: str, names: list[str] | None = None) -> list[int]:
    """Mark dead every process that left live-gauge files and no longer runs."""
    if names is None:
        try:
            names = _db_files(directory)
        except OSError:
            return []
    dead = set()
    for n in names:
        name = parse_name(n)
        if name is not None and name.mode is not None and name.mode.startswith("live") \
                and name.pid != os.getpid() and not _alive(name.pid):
            dead.add(name.pid)
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


#: Parsed keys kept between scrapes; past this many (keys of files long gone) they are
#: dropped and parsed again as needed.
_MAX_KEYS = 200_000


@dataclass(frozen=True)
class _Settled:
    """A dead process's file as last read: its identity, and why it was left out if it was."""

    identity: tuple[int, int, int, int]
    why: str | None = None


class TolerantMultiProcessCollector(Collector):
    """Every process's values from ``directory``, leaving out files that cannot be read.

    ``on_bad_file`` is called once per unreadable file per scrape, before this
    process's own files are read (so a counter it increments in this process shows on
    that same page).
    """

    def __init__(self, directory: str, on_bad_file: Callable[[str], None]) -> None:
        self.directory = directory
        self.on_bad_file = on_bad_file
        #: Scrapes failed because the directory could not be listed.
        self.unavailable = 0
        self._lock = threading.Lock()  # scrapes may render on two threads at once
        self._logged: set[str] = set()
        self._outage: str | None = None
        self._keys: dict[bytes, Key] = {}
        #: Dead processes' files, and the merge of the readable ones.
        self._settled: dict[str, _Settled] = {}
        self._settled_merge = Merged()
        #: Live files' last bytes and entries: a file that did not change is not parsed.
        self._recent: dict[str, tuple[bytes, tuple[Entry, ...]]] = {}

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            return iter(self._collect())

    def _collect(self) -> list[Metric]:
        names = self._list()
        if reap_dead_processes(self.directory, names):
            names = self._list()
        me = os.getpid()
        live: list[tuple[str, FileName]] = []
        dead: dict[str, FileName] = {}
        bad: list[tuple[str, str]] = []
        alive: dict[int, bool] = {}
        for n in names:
            name = parse_name(n)
            if name is None:
                bad.append((n, "not a prometheus-client file name with a valid pid"))
            elif name.pid != me and not alive.setdefault(name.pid, _alive(name.pid)):
                dead[n] = name
            elif name.pid != me:
                live.append((n, name))
        bad.extend(self._settle(dead))
        merged = self._settled_merge.copy()
        bad.extend(self._add_live(live, merged))
        for n, why in bad:
            self._bad(n, why)
        # This process's files last: counting the bad files above may have made one.
        names = self._list() if bad else names
        mine = [(n, name) for n in names
                if (name := parse_name(n)) is not None and name.pid == me]
        for n, why in self._add_live(mine, merged):
            self._bad(n, why)
        reading = {n for n, _ in live} | {n for n, _ in mine}
        self._recent = {n: v for n, v in self._recent.items() if n in reading}
        if len(self._keys) > _MAX_KEYS:
            self._keys.clear()
        return merged.metrics()

    def _list(self) -> list[str]:
        try:
            names = _db_files(self.directory)
        except OSError as e:
            self.unavailable += 1
            why = f"PROMETHEUS_MULTIPROC_DIR {self.directory!r} cannot be read: " \
                  f"{e.strerror or type(e).__name__}"
            if self._outage != why:
                self._outage = why
                log.error("kvmetrics: %s; every scrape fails (HTTP 503) until it is back", why)
            raise PageUnavailable(why) from None
        if self._outage is not None:
            log.warning("kvmetrics: PROMETHEUS_MULTIPROC_DIR %r is readable again",
                        self.directory)
            self._outage = None
        return names

    def _settle(self, dead: dict[str, FileName]) -> list[tuple[str, str]]:
        """Bring the merge of the dead processes' files up to date: a new one is read
        and added; one that changed or went away makes them all be read again (rare:
        a dead process's file changes only if its pid is reused or someone edits it)."""
        identities = {}
        for n in dead:
            try:
                st = os.stat(os.path.join(self.directory, n), follow_symlinks=False)
            except OSError:
                continue  # gone since the listing
            identities[n] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        rebuild = any(identities.get(n) != s.identity for n, s in self._settled.items())
        if rebuild:
            self._settled, self._settled_merge = {}, Merged()
        for n, identity in identities.items():
            if n in self._settled:
                continue
            try:
                entries = parse_entries(read_bytes(os.path.join(self.directory, n)),
                                        self._keys)
            except FileNotFoundError:
                continue
            except BadFile as e:
                self._settled[n] = _Settled(identity, str(e))
                continue
            self._settled[n] = _Settled(identity)
            self._settled_merge.add(dead[n], entries)
        return [(n, s.why) for n, s in self._settled.items() if s.why is not None]

    def _add_live(self, files: list[tuple[str, FileName]],
                  merged: Merged) -> list[tuple[str, str]]:
        bad = []
        for n, name in files:
            path = os.path.join(self.directory, n)
            try:
                data = read_bytes(path)
                seen = self._recent.get(n)
                if seen is not None and seen[0] == data:
                    entries = seen[1]
                else:
                    entries = parse_entries(data, self._keys)
                    self._recent[n] = (data, entries)
            except FileNotFoundError:
                continue  # a process marked dead since the listing
            except BadFile as e:
                bad.append((n, str(e)))
                continue
            merged.add(name, entries)
        return bad

    def _bad(self, n: str, why: str) -> None:
        self.on_bad_file(os.path.join(self.directory, n))
        if n not in self._logged:
            self._logged.add(n)
            log.error("kvmetrics: skipping multiprocess file %s (%s)",
                      os.path.join(self.directory, n), why[:200])
