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
* A valid file can hold any number of series (800,000 under the size cap: 14-29 s and
  a gigabyte a scrape). Here a scrape reads at most a budget of series, bytes and
  time (:class:`~kvmetrics.exporters.mpfiles.ScrapeBudget`); a file that would pass it
  is left out, logged once and counted in
  ``kvmetrics_scrape_errors_total{reason="multiprocess_file_over_budget"}``, and the
  rest are served.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import mark_process_dead
from prometheus_client.registry import Collector

from kvmetrics.exporters import mmap_space
from kvmetrics.exporters.mpfiles import (
    BadFile,
    Entry,
    FileName,
    Key,
    Merged,
    OverBudget,
    ScrapeBudget,
    parse_entries,
    parse_name,
    read_bytes,
)
from kvmetrics.exporters.pages import PageUnavailable
from kvmetrics.metrics.logs import get_logger

log = get_logger("kvmetrics.multiprocess")


def process_alive(pid: int) -> bool:
    """Whether ``pid`` may be a live process: False only when it is known gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # EPERM: someone else's live process; else not known
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
                and name.pid != os.getpid() and not process_alive(name.pid):
            dead.add(name.pid)
    for pid in sorted(dead):
        with contextlib.suppress(OSError):  # another process reaped it first
            mark_process_dead(pid, directory)
    return sorted(dead)


#: Open lifetimes by (pid, directory): several sinks of one process (the lab runs
#: some side by side) share the process's files, so only the last to close marks it dead.
_open_lifetimes: dict[tuple[int, str], int] = {}
_lifetimes_lock = threading.Lock()


class ProcessLifetime:
    """Marks this process dead in ``directory`` once its last lifetime there closes:
    on :meth:`close` or at exit."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.pid = os.getpid()
        self._closed = False
        with _lifetimes_lock:
            key = (self.pid, directory)
            _open_lifetimes[key] = _open_lifetimes.get(key, 0) + 1
        reap_dead_processes(directory)
        atexit.register(self.close)

    def close(self) -> None:
        if self._closed or os.getpid() != self.pid:  # a forked child is not us
            return
        self._closed = True
        with _lifetimes_lock:
            key = (self.pid, self.directory)
            left = _open_lifetimes.get(key, 1) - 1
            if left > 0:
                _open_lifetimes[key] = left
                return  # another sink of this process still uses its files
            _open_lifetimes.pop(key, None)
        mmap_space.flush()  # every update in the files before the process is marked dead
        mmap_space.retire()  # its live-gauge files go on purpose: not repaired
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
    over_budget: bool = False


class _Spending:
    """What is left of one scrape's budget."""

    def __init__(self, budget: ScrapeBudget) -> None:
        self.budget = budget
        self.deadline = time.monotonic() + budget.max_seconds
        self.bytes_left = budget.max_bytes

    def read_live(self, path: str) -> bytes:
        """A file's bytes, charged to the budget; OverBudget when time or bytes are spent."""
        if time.monotonic() > self.deadline:
            raise OverBudget(f"the scrape's {self.budget.max_seconds:g} s were spent "
                             "on the files before it")
        data = read_bytes(path, budget_bytes=self.bytes_left)
        self.bytes_left -= len(data)
        return data

    def read(self, path: str, keys: dict[bytes, Key],
             merged: Merged, name: FileName) -> tuple[bytes, tuple[Entry, ...]]:
        data = self.read_live(path)
        return data, self.parse(data, keys, merged, name)

    def parse(self, data: bytes, keys: dict[bytes, Key], merged: Merged,
              name: FileName) -> tuple[Entry, ...]:
        entries = parse_entries(data, keys, self.budget.max_series, self.deadline)
        self.admit(entries, merged, name)
        return entries

    def admit(self, entries: tuple[Entry, ...], merged: Merged, name: FileName) -> None:
        if merged.series() + merged.new_series(name, entries) > self.budget.max_series:
            raise OverBudget(f"its series would pass the page's budget of "
                             f"{self.budget.max_series}")


class TolerantMultiProcessCollector(Collector):
    """Every process's values from ``directory``, leaving out files that cannot be read.

    ``on_bad_file`` is called once per unreadable file per scrape, and
    ``on_over_budget`` once per file left out for the scrape's ``budget``, before this
    process's own files are read (so a counter it increments in this process shows on
    that same page).
    """

    def __init__(self, directory: str, on_bad_file: Callable[[str], None],
                 on_over_budget: Callable[[str], None] | None = None,
                 budget: ScrapeBudget | None = None) -> None:
        self.directory = directory
        self.on_bad_file = on_bad_file
        self.on_over_budget = on_over_budget or (lambda _path: None)
        self.budget = budget or ScrapeBudget()
        #: Scrapes failed because the directory could not be listed.
        self.unavailable = 0
        self._lock = threading.Lock()  # scrapes may render on two threads at once
        self._logged: set[tuple[str, bool]] = set()
        self._outage: str | None = None
        self._keys: dict[bytes, Key] = {}
        #: Dead processes' files, and the merge of the readable ones.
        self._settled: dict[str, _Settled] = {}
        self._settled_merge = Merged()
        #: Live files' last bytes and entries: a file that did not change is not parsed.
        self._recent: dict[str, tuple[bytes, tuple[Entry, ...]]] = {}
        #: Live files refused for holding more series than the budget, by the bytes
        #: they had (their keys are set by those bytes: parsed again only if they change).
        self._too_many: dict[str, bytes] = {}

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
        bad: list[tuple[str, str, bool]] = []
        alive: dict[int, bool] = {}
        for n in names:
            name = parse_name(n)
            if name is None:
                bad.append((n, "not a prometheus-client file name with a valid pid", False))
            elif name.pid != me and not alive.setdefault(name.pid, process_alive(name.pid)):
                dead[n] = name
            elif name.pid != me:
                live.append((n, name))
        spending = _Spending(self.budget)
        bad.extend(self._settle(dead, spending))
        merged = self._settled_merge.copy()
        bad.extend(self._add_live(live, merged, spending))
        for n, why, over in bad:
            self._bad(n, why, over)
        # This process's files last, outside the budget (its own series caps bound them):
        # counting the files above may have made one. Flushed first, so that they hold
        # the latest values, those counts included (on the scraping thread, never the
        # engine's).
        mmap_space.flush()
        names = self._list() if bad else names
        mine = [(n, name) for n in names
                if (name := parse_name(n)) is not None and name.pid == me]
        for n, why, over in self._add_live(mine, merged, None):
            self._bad(n, why, over)
        reading = {n for n, _ in live} | {n for n, _ in mine}
        self._recent = {n: v for n, v in self._recent.items() if n in reading}
        self._too_many = {n: v for n, v in self._too_many.items() if n in reading}
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

    def _settle(self, dead: dict[str, FileName],
                spending: _Spending) -> list[tuple[str, str, bool]]:
        """Bring the merge of the dead processes' files up to date: a new one is read
        and added; one that changed or went away makes them all be read again (rare:
        a dead process's file changes only if its pid is reused or someone edits it).
        One the budget left out this scrape is tried again on the next (one that alone
        holds too many series, only if it changes)."""
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
        passed = []
        for n, identity in identities.items():
            if n in self._settled:
                continue
            try:
                _, entries = spending.read(os.path.join(self.directory, n), self._keys,
                                           self._settled_merge, dead[n])
            except FileNotFoundError:
                continue
            except OverBudget as e:
                if e.lasting:
                    self._settled[n] = _Settled(identity, str(e), over_budget=True)
                else:
                    passed.append((n, str(e), True))
                continue
            except BadFile as e:
                self._settled[n] = _Settled(identity, str(e))
                continue
            self._settled[n] = _Settled(identity)
            self._settled_merge.add(dead[n], entries)
        return passed + [(n, s.why, s.over_budget) for n, s in self._settled.items()
                         if s.why is not None]

    def _add_live(self, files: list[tuple[str, FileName]], merged: Merged,
                  spending: _Spending | None) -> list[tuple[str, str, bool]]:
        """Add each live file (within ``spending``, or unbounded when None)."""
        bad = []
        for n, name in files:
            path = os.path.join(self.directory, n)
            try:
                data = read_bytes(path) if spending is None else spending.read_live(path)
                if self._too_many.get(n) == data:
                    raise OverBudget(f"more than {self.budget.max_series} series, the "
                                     "scrape's budget (unchanged since)")
                seen = self._recent.get(n)
                if seen is not None and seen[0] == data:
                    entries = seen[1]
                    if spending is not None:
                        spending.admit(entries, merged, name)
                elif spending is None:
                    entries = parse_entries(data, self._keys)
                else:
                    try:
                        entries = spending.parse(data, self._keys, merged, name)
                    except OverBudget as e:
                        if e.lasting:
                            self._too_many[n] = data
                        raise
                self._recent[n] = (data, entries)
            except FileNotFoundError:
                continue  # a process marked dead since the listing
            except OverBudget as e:
                bad.append((n, str(e), True))
                continue
            except BadFile as e:
                bad.append((n, str(e), False))
                continue
            merged.add(name, entries)
        return bad

    def _bad(self, n: str, why: str, over_budget: bool) -> None:
        path = os.path.join(self.directory, n)
        (self.on_over_budget if over_budget else self.on_bad_file)(path)
        said = (n, over_budget)
        if said not in self._logged:
            self._logged.add(said)
            log.error("kvmetrics: skipping multiprocess file %s (%s)", path, why[:200])
