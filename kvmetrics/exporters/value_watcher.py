"""The thread that writes this process's multiprocess value files and repairs them.

One per process (a forked child starts its own with its first file): every
:data:`FLUSH_INTERVAL_S` it writes the values updated since its last round
(:meth:`~kvmetrics.exporters.mmap_space.ValueFile.flush`), and every
:data:`CHECK_INTERVAL_S` it compares each file and its directory with what was
written and has a damaged file rewritten from the values in memory. Why the flush lag
loses nothing a scrape would read: :mod:`kvmetrics.exporters.mmap_space`.

The interval is 0.1 s: a scrape reads at most that far behind, under a tenth of the
shortest scrape intervals in use (1 s and up); every key updated in it is written
once, so a step loop of 100 steps a second costs about one write per key per ten
steps; and the thread wakes ten times a second, each wake a brief hold of the GIL
(nothing to do when nothing changed).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmetrics.exporters.value_layout import identity
from kvmetrics.metrics.logs import get_logger

if TYPE_CHECKING:
    from kvmetrics.exporters.mmap_space import ValueFile

log = get_logger("kvmetrics.multiprocess")

#: How often the thread writes the values updated since its last round.
FLUSH_INTERVAL_S = 0.1
#: How often the thread compares the files and their directory with what was written.
CHECK_INTERVAL_S = 1.0


#: Called with (what happened, where) after the watcher rewrote files; bound methods
#: are held weakly (a sink that is gone is not kept alive by this list).
_listeners: list[Callable[[], Callable[[str, str], None] | None]] = []


def on_rewrite(listener: Callable[[str, str], None]) -> None:
    """Call ``listener(what, where)`` for every repair the watcher makes (``what``:
    deleted, replaced, truncated, overwritten, unwritable, unopened or
    directory_recreated), every repair that failed (``rewrite_failed``) and every new
    series held in memory only because its file had no room (``series_unstored``). It
    runs on the watcher's thread, never under a file's lock."""
    if hasattr(listener, "__self__"):
        _listeners.append(weakref.WeakMethod(listener))
    else:
        _listeners.append(lambda: listener)


class Watcher:
    """One thread per process that writes this process's updated values every
    :data:`FLUSH_INTERVAL_S` and repairs its value files every :data:`CHECK_INTERVAL_S`."""

    def __init__(self) -> None:
        self._files: weakref.WeakSet[ValueFile] = weakref.WeakSet()
        self._directories: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._pid = -1
        self._retired = False
        #: Rewrites done, by what happened (for tests and the log).
        self.rewrites: dict[str, int] = {}
        #: Events noted on other threads (under a file's lock), told to the listeners
        #: by the watcher's thread: what -> (count, a place it happened).
        self._events: dict[str, tuple[int, str]] = {}
        self._events_lock = threading.Lock()
        #: What has been logged already (one line per kind and file until it changes).
        self._logged: set[tuple[str, str]] = set()

    def note(self, what: str, where: str, error: OSError) -> None:
        """Record an event for the listeners (any thread, a file's lock held): told on
        the watcher's next round; logged once per kind and process."""
        with self._events_lock:
            count, _ = self._events.get(what, (0, where))
            self._events[what] = (count + 1, where)
            first = (what, "") not in self._logged
            self._logged.add((what, ""))
        if first:
            log.error("kvmetrics: a new series of pid %d is kept in memory only, not in "
                      "%s: %s (counted; the file is retried once a second)", os.getpid(),
                      where, error.strerror or error)

    def _tell(self) -> None:
        """Give the events noted since the last round to the listeners."""
        with self._events_lock:
            events, self._events = self._events, {}
        for what, (count, where) in events.items():
            for _ in range(count):
                _notify(what, where)

    def add(self, f: ValueFile) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first file, or a forked child: no thread yet
                self._pid = os.getpid()
                self._files = weakref.WeakSet()
                self._directories = {}
                self._retired = False
                self._events_lock = threading.Lock()
                self._events = {}
                threading.Thread(target=self._run, name="kvmetrics-mp-files",
                                 daemon=True).start()
                atexit.register(self.flush)  # a clean exit loses no update
                # A forked multiprocessing child ends with os._exit: no atexit there.
                multiprocessing.util.Finalize(None, self.flush, exitpriority=100)
            self._files.add(f)
            directory = os.path.dirname(f.path)
            if directory not in self._directories:
                with contextlib.suppress(OSError):
                    self._directories[directory] = identity(os.stat(directory))

    def discard(self, f: ValueFile) -> None:
        with self._lock:
            self._files.discard(f)

    def after_fork(self) -> None:
        """In a forked child: locks the watcher's thread may have held at the fork are
        new (the library then closes the parent's files and opens the child's own)."""
        self._lock = threading.Lock()
        self._events_lock = threading.Lock()
        self._events = {}
        for f in list(self._files):
            f._lock = threading.Lock()

    @property
    def retired(self) -> bool:
        return self._retired

    def retire(self) -> None:
        """Stop repairing: the process is about to mark itself dead (its live-gauge
        files are removed on purpose). A rewrite checks the flag under its file's lock;
        taking each lock once here waits out any rewrite already past that check, so
        none brings a file back after this returns."""
        self._retired = True
        with self._lock:
            files = list(self._files)
        for f in files:
            f.wait_for_rewrite()

    def flush(self) -> None:
        """Write every value this process updated since the last round."""
        with self._lock:
            files = list(self._files)
        for f in files:
            try:
                f.flush()
            except Exception as e:  # the thread must outlive anything a directory does
                log.warning("kvmetrics: writing %s failed: %s", f.path, e)

    def _run(self) -> None:
        pid = os.getpid()
        next_check = time.monotonic() + CHECK_INTERVAL_S
        while self._pid == pid:
            time.sleep(FLUSH_INTERVAL_S)
            if self._pid != pid:
                return
            self.flush()
            with contextlib.suppress(Exception):
                self._tell()
            if time.monotonic() < next_check:
                continue
            next_check = time.monotonic() + CHECK_INTERVAL_S
            try:
                self.check()
            except Exception as e:  # the thread must outlive anything a directory does
                log.warning("kvmetrics: checking the multiprocess files failed: %s", e)

    def check(self) -> None:
        """One round: rewrite what was damaged, count it, say it in one line."""
        if self._retired:
            return
        with self._lock:
            files = list(self._files)
            directories = dict(self._directories)
        by_directory: dict[str, list[ValueFile]] = {}
        for f in files:
            by_directory.setdefault(os.path.dirname(f.path), []).append(f)
        for directory, group in by_directory.items():
            try:
                now = identity(os.stat(directory))
            except OSError:
                continue  # gone or unreadable: the scrape says so; wait for it
            if directories.get(directory) not in (None, now):
                self._repair(group, "directory_recreated", directory)
            else:
                for f in group:
                    what = f.damage()
                    if what is not None:
                        self._repair([f], what, f.path)
                    else:
                        f.place_unstored()
            with self._lock:
                self._directories[directory] = now

    def _repair(self, group: list[ValueFile], what: str, where: str) -> None:
        """Rewrite ``group``; a rewrite that worked is counted as ``what``, one that
        failed as ``rewrite_failed`` (logged once per file until it works again)."""
        failed, rewrote = [], 0
        for f in group:
            try:
                rewrote += f.rewrite()
            except OSError as e:
                failed.append(f"{os.path.basename(f.path)}: {e.strerror or e}")
                _notify("rewrite_failed", f.path)
                if ("rewrite_failed", f.path) not in self._logged:
                    self._logged.add(("rewrite_failed", f.path))
                    log.error("kvmetrics: multiprocess value file %s of pid %d %s and "
                              "could not be rewritten: %s (retried once a second)",
                              f.path, os.getpid(), _SAID[what], e.strerror or e)
            else:
                self._logged.discard(("rewrite_failed", f.path))
        if not rewrote:
            return
        self.rewrites[what] = self.rewrites.get(what, 0) + 1
        log.error("kvmetrics: multiprocess value files of pid %d %s (%s): rewrote %d "
                  "file(s) from the values in memory", os.getpid(),
                  _SAID[what], where, rewrote)
        _notify(what, where)


def _notify(what: str, where: str) -> None:
    for ref in list(_listeners):
        listener = ref()
        if listener is not None:
            with contextlib.suppress(Exception):
                listener(what, where)


_SAID = {"deleted": "deleted", "replaced": "replaced by another file",
         "truncated": "truncated", "overwritten": "overwritten in place",
         "directory_recreated": "lost: the directory was deleted and made again",
         "unwritable": "refused every write", "unopened": "could not be opened"}

WATCHER = Watcher()
os.register_at_fork(after_in_child=WATCHER.after_fork)
