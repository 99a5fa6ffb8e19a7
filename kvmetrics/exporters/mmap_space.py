"""The writer of this process's multiprocess value files: nothing done to them kills it.

prometheus-client keeps a process's values in ``*.db`` files it maps into memory and
writes through the mapping. Two things anyone who can write the directory (or fill
its filesystem) can do then kill the process with SIGBUS (exit 135, no message; inside
vLLM that process is the EngineCore): truncate a live file (every later store to a
page past the new end faults), or fill the filesystem (the library grows a file with
``truncate``, which allocates nothing, and the first store to a page with no block
behind it faults).

:class:`ValueFile` keeps the library's file format, names and growth, but holds the
values in memory and writes each update with ``pwrite``: a write past the end of a
truncated file extends it, a write with no room is an ``OSError`` (the value stays
in memory for the watcher's rewrite), never a fault. Every byte of a file is
allocated with ``posix_fallocate`` before it is used, so a full filesystem is an
``OSError`` when a new series needs room (the exporter drops that series and counts
it).

A watcher thread (:class:`_Watcher`), once a second, compares each file with what
this process wrote: a file truncated, replaced, deleted or overwritten in place, or
its directory deleted and made again, is written anew from the values in memory (a
new file renamed into place), counted through the listeners of
:func:`on_rewrite` and logged in one line. The check costs a few system calls per
file per second on a thread of its own, none per write.

The files are per process and shared by every metric of that process (vLLM's own
too), so the class has to be the one the library uses:
:func:`reserve_multiprocess_space` points prometheus-client's file class at it, once.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable

from prometheus_client import values
from prometheus_client.mmap_dict import MmapedDict

from kvmetrics.metrics.logs import get_logger

log = get_logger("kvmetrics.multiprocess")

#: The size prometheus-client gives a new file (``mmap_dict._INITIAL_MMAP_SIZE``).
_INITIAL_SIZE = 1 << 16
#: How often the watcher compares the files and their directory with what was written.
CHECK_INTERVAL_S = 1.0

_INT = struct.Struct("i")  # native, as prometheus-client writes it
_TWO_DOUBLES = struct.Struct("dd")
_pack_two_doubles = _TWO_DOUBLES.pack
_pwrite = os.pwrite


def _entry(key: str) -> bytes:
    """One new value as the library lays it out: a 4-byte length, the key padded so
    that the two doubles after it are 8-byte aligned, and those two doubles."""
    encoded = key.encode("utf-8")
    padded = encoded + b" " * (8 - (len(encoded) + 4) % 8)
    return _INT.pack(len(encoded)) + padded + _TWO_DOUBLES.pack(0.0, 0.0)


def _reserve(fd: int, start: int, end: int) -> None:
    """Allocate bytes [start, end) of ``fd`` or raise OSError leaving its size as it was."""
    if end <= start:
        return
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError:
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_size != start:
                os.ftruncate(fd, start)  # a partial allocation must not look like room
        raise


def _existing_values(data: bytes) -> dict[str, tuple[int, float, float]]:
    """The (position, value, timestamp) of each key in a file left by an earlier
    process with this pid; empty when its bytes are not a value file."""
    found: dict[str, tuple[int, float, float]] = {}
    used = _INT.unpack_from(data)[0] if len(data) >= 8 else 0
    if used < 8 or used > len(data):
        return {}
    pos = 8
    while pos < used:
        n = _INT.unpack_from(data, pos)[0] if pos + 4 <= used else -1
        end = pos + 4 + n + (8 - (n + 4) % 8) + 16
        if n <= 0 or end > used:
            return {}
        try:
            key = data[pos + 4:pos + 4 + n].decode("utf-8")
        except UnicodeDecodeError:
            return {}
        found[key] = (end - 16, *_TWO_DOUBLES.unpack_from(data, end - 16))
        pos = end
    return found


class ValueFile:
    """prometheus-client's value file (``values.MmapedDict``'s interface), written
    with ``pwrite`` from values kept in memory, its space allocated before use."""

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        del read_mode  # the library opens its value files to write only
        self._path = filename
        self._lock = threading.Lock()
        self._fd, self._capacity = _open_reserved(filename)
        try:
            data = os.pread(self._fd, self._capacity, 0)
            found = _existing_values(data)
        except OSError:
            found = {}
        self._positions = {k: pos for k, (pos, _, _) in found.items()}
        self._values = {k: (v, ts) for k, (_, v, ts) in found.items()}
        self._used = max((pos + 16 for pos in self._positions.values()), default=8)
        if not found:
            os.pwrite(self._fd, _INT.pack(8) + bytes(4), 0)
        self._identity = _identity(os.fstat(self._fd))
        _WATCHER.add(self)

    @property
    def path(self) -> str:
        return self._path

    def read_value(self, key: str) -> tuple[float, float]:
        with self._lock:
            if key not in self._positions:
                self._add(key)
                self._values[key] = (0.0, 0.0)
            return self._values[key]

    def write_value(self, key: str, value: float, timestamp: float) -> None:
        with self._lock:
            pos = self._positions.get(key)
            if pos is None:
                pos = self._add(key)
            self._values[key] = (value, timestamp)
            try:  # noqa: SIM105 (on the engine's path: a try costs nothing, suppress a call)
                _pwrite(self._fd, _pack_two_doubles(value, timestamp), pos)
            except OSError:
                # No room where a truncated file lost its blocks, or EIO: the value is
                # kept, and the watcher rewrites the file (or says why it cannot).
                pass

    def read_all_values(self):  # type: ignore[no-untyped-def]
        """Yield (key, value, timestamp), as the library's class does."""
        with self._lock:
            items = list(self._values.items())
        for key, (value, timestamp) in items:
            yield key, value, timestamp

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = -1
        _WATCHER.discard(self)

    def _add(self, key: str) -> int:
        """Append a new key (lock held); OSError, with nothing changed, when the file
        cannot grow."""
        entry = _entry(key)
        capacity = self._capacity
        while self._used + len(entry) > capacity:
            capacity *= 2
        if capacity > self._capacity:
            _reserve(self._fd, self._capacity, capacity)
            self._capacity = capacity
        os.pwrite(self._fd, entry, self._used)
        self._used += len(entry)
        os.pwrite(self._fd, _INT.pack(self._used), 0)
        self._positions[key] = self._used - 16
        return self._used - 16

    def damage(self) -> str | None:
        """What was done to the file since this process wrote it, or None."""
        with self._lock:
            if self._fd < 0:
                return None
            try:
                on_disk = os.stat(self._path, follow_symlinks=False)
            except FileNotFoundError:
                return "deleted"
            except OSError:
                return None  # cannot tell (the directory unreadable): the next check will
            try:
                own = os.fstat(self._fd)
                if _identity(on_disk) != self._identity:
                    return "replaced"
                if own.st_size < self._capacity:
                    return "truncated"
                if os.pread(self._fd, 4, 0) != _INT.pack(self._used):
                    return "overwritten"
            except OSError:
                return None
            return None

    def rewrite(self) -> None:
        """Write every value held into a new file at the path (made next to it, then
        renamed over it) and write to that file from now on; OSError leaves the
        current one in use."""
        with self._lock:
            if self._fd < 0:
                return
            content = bytearray(self._used)
            content[0:4] = _INT.pack(self._used)
            for key, pos in self._positions.items():
                entry = _entry(key)
                start = pos + 16 - len(entry)
                content[start:pos] = entry[:-16]
                content[pos:pos + 16] = _TWO_DOUBLES.pack(*self._values.get(key, (0.0, 0.0)))
            directory, name = os.path.split(self._path)
            temporary = os.path.join(directory, f".{name}.{os.getpid()}.new")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)  # made new: nothing planted there is written through
            fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644)
            try:
                _reserve(fd, 0, self._capacity)
                os.pwrite(fd, bytes(content), 0)
                os.rename(temporary, self._path)
            except OSError:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
            old, self._fd = self._fd, fd
            self._identity = _identity(os.fstat(fd))
            with contextlib.suppress(OSError):
                os.close(old)


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _open_reserved(filename: str) -> tuple[int, int]:
    """Open ``filename`` (new, or left by an earlier process with our pid) with real
    blocks for its whole size: (fd, size). A file this call made and could not fill
    is removed: an empty ``*.db`` left behind would fail every scrape of
    prometheus-client's own collector (vLLM's ``/metrics``)."""
    fd = os.open(filename, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        size = os.fstat(fd).st_size
        capacity = max(size, _INITIAL_SIZE)
        _reserve(fd, 0, capacity)
    except OSError:
        os.close(fd)
        if size == 0:
            with contextlib.suppress(OSError):
                os.unlink(filename)
        raise
    return fd, capacity


#: Called with (what happened, where) after the watcher rewrote files; bound methods
#: are held weakly (a sink that is gone is not kept alive by this list).
_listeners: list[Callable[[], Callable[[str, str], None] | None]] = []


def on_rewrite(listener: Callable[[str, str], None]) -> None:
    """Call ``listener(what, where)`` for every repair the watcher makes (``what``:
    deleted, replaced, truncated, overwritten, or directory_recreated). It runs on the
    watcher's thread."""
    if hasattr(listener, "__self__"):
        _listeners.append(weakref.WeakMethod(listener))  # type: ignore[arg-type]
    else:
        _listeners.append(lambda: listener)


class _Watcher:
    """One thread per process that repairs this process's value files."""

    def __init__(self) -> None:
        self._files: weakref.WeakSet[ValueFile] = weakref.WeakSet()
        self._directories: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._pid = -1
        self._retired = False
        #: Rewrites done, by what happened (for tests and the log).
        self.rewrites: dict[str, int] = {}

    def add(self, f: ValueFile) -> None:
        with self._lock:
            if self._pid != os.getpid():  # first file, or a forked child: no thread yet
                self._pid = os.getpid()
                self._files = weakref.WeakSet()
                self._directories = {}
                self._retired = False
                threading.Thread(target=self._run, name="kvmetrics-mp-files",
                                 daemon=True).start()
            self._files.add(f)
            directory = os.path.dirname(f.path)
            if directory not in self._directories:
                with contextlib.suppress(OSError):
                    self._directories[directory] = _identity(os.stat(directory))

    def discard(self, f: ValueFile) -> None:
        with self._lock:
            self._files.discard(f)

    def after_fork(self) -> None:
        """In a forked child: locks the watcher's thread may have held at the fork are
        new (the library then closes the parent's files and opens the child's own)."""
        self._lock = threading.Lock()
        for f in list(self._files):
            f._lock = threading.Lock()

    def retire(self) -> None:
        """Stop repairing: the process has marked itself dead (its live-gauge files
        are removed on purpose)."""
        self._retired = True

    def _run(self) -> None:
        pid = os.getpid()
        while self._pid == pid:
            time.sleep(CHECK_INTERVAL_S)
            if self._pid != pid:
                return
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
                now = _identity(os.stat(directory))
            except OSError:
                continue  # gone or unreadable: the scrape says so; wait for it
            if directories.get(directory) not in (None, now):
                self._repair(group, "directory_recreated", directory)
            else:
                for f in group:
                    what = f.damage()
                    if what is not None:
                        self._repair([f], what, f.path)
            with self._lock:
                self._directories[directory] = now

    def _repair(self, group: list[ValueFile], what: str, where: str) -> None:
        failed = []
        for f in group:
            try:
                f.rewrite()
            except OSError as e:
                failed.append(f"{os.path.basename(f.path)}: {e.strerror or e}")
        self.rewrites[what] = self.rewrites.get(what, 0) + 1
        outcome = f"; could not rewrite {', '.join(failed)}" if failed else ""
        log.error("kvmetrics: multiprocess value files of pid %d %s (%s): rewrote %d "
                  "file(s) from the values in memory%s", os.getpid(),
                  _SAID[what], where, len(group) - len(failed), outcome)
        for ref in list(_listeners):
            listener = ref()
            if listener is not None:
                with contextlib.suppress(Exception):
                    listener(what, where)


_SAID = {"deleted": "deleted", "replaced": "replaced by another file",
         "truncated": "truncated", "overwritten": "overwritten in place",
         "directory_recreated": "lost: the directory was deleted and made again"}

_WATCHER = _Watcher()
os.register_at_fork(after_in_child=_WATCHER.after_fork)


def check_now() -> None:
    """Run the watcher's check at once (tests; the thread runs it every second)."""
    _WATCHER.check()


def retire() -> None:
    """This process has marked itself dead: its files are no longer repaired."""
    _WATCHER.retire()


def reserve_multiprocess_space() -> None:
    """Make every value file this process creates from now on a :class:`ValueFile`.

    Files opened before (by metrics created earlier in the process) keep the library's
    class; the exporter calls this before it creates any metric.
    """
    if values.MmapedDict is MmapedDict:
        values.MmapedDict = ValueFile  # type: ignore[misc,assignment]
