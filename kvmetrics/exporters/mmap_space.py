"""The writer of this process's multiprocess value files: nothing done to them kills it.

prometheus-client keeps a process's values in ``*.db`` files it maps into memory and
writes through the mapping. Two things anyone who can write the directory (or fill
its filesystem) can do then kill the process with SIGBUS (exit 135, no message; inside
vLLM that process is the EngineCore): truncate a live file (every later store to a
page past the new end faults), or fill the filesystem (the library grows a file with
``truncate``, which allocates nothing, and the first store to a page with no block
behind it faults).

:class:`ValueFile` keeps the library's file format, names and growth, but holds the
values in memory. An update stores the value in a dict and marks its key dirty: no
system call on the engine's thread (a memory store is what the library's ``mmap``
costs too). A thread of the process (:mod:`kvmetrics.exporters.value_watcher`) writes
the dirty values with ``pwrite`` every ``FLUSH_INTERVAL_S`` (0.1 s), each key once
however often it changed, and neighbouring values in one write. ``pwrite`` cannot
fault: a write past the end of a truncated file extends it, a write with no room is an
``OSError`` (the values stay dirty for the next round and the rewrite below). Every
byte of a file is allocated with ``posix_fallocate`` before it is used; a new series
(a key not yet in the file, first use of a label set) is written at once, so a full
filesystem is known when room is asked for. Nothing raises into the caller (vLLM's own
metrics use this class): a series with no room, or whose file could not be opened, is
held in memory only, counted and logged once, until the watcher's rewrite places it.

Why the lag loses nothing a scrape would have read: a scrape reads the files at most
one flush interval behind the engine, a tenth of a second against scrape intervals of
seconds, and counters stay monotonic on disk (the thread always writes a key's latest
value). A clean exit writes everything first: :func:`flush` runs at exit (``atexit``,
and the finalizers of a forked ``multiprocessing`` child), when the library closes
its files, and before the process marks itself dead. What an unclean death (SIGKILL,
a native crash) loses is at most its last interval; the exporter process that serves
an engine's private directory dies with the engine and removes the directory, so no
later scrape could have shown those values anyway. Only a directory shared with
processes that outlive it (one set with ``PROMETHEUS_MULTIPROC_DIR``) keeps a killed
engine's files, without its last interval of updates.

The same thread, once a second (``CHECK_INTERVAL_S``), compares each file with what
this process wrote: a file truncated, replaced, deleted or overwritten in place,
or its directory deleted and made again, is written anew from the values in memory
(a new file renamed into place), counted through the listeners of :func:`on_rewrite`
and logged in one line.

The files are per process and shared by every metric of that process (vLLM's own
too), so the class has to be the one the library uses:
:func:`reserve_multiprocess_space` points prometheus-client's file class at it, once.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading

from prometheus_client import values
from prometheus_client.mmap_dict import MmapedDict

from kvmetrics.exporters.value_layout import (
    INITIAL_SIZE,
    INT,
    TWO_DOUBLES,
    entry,
    existing_values,
    identity,
    open_reserved,
    read_used,
    reserve,
)
from kvmetrics.exporters.value_watcher import (  # noqa: F401 (on_rewrite: the module's API)
    CHECK_INTERVAL_S,
    FLUSH_INTERVAL_S,
    WATCHER,
    on_rewrite,
)

#: Dirty values this close together are written in one ``pwrite`` (the bytes between
#: them, keys and values already on disk, are written again unchanged).
_SPAN_GAP = 4096


class ValueFile:
    """prometheus-client's value file (``values.MmapedDict``'s interface): the values
    kept in memory, written to the file by the watcher's thread with ``pwrite``, its
    space allocated before use.

    An update is a dict store and a set insert, no system call; a new series (a key
    not yet in the file) is written at once, since it may need room the filesystem
    refuses. ``_image`` holds the file's bytes as last written (values of keys that are
    not dirty equal the file's), so that contiguous dirty values go out in one write.
    """

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        del read_mode  # the library opens its value files to write only
        self._path = filename
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._closed = False
        #: Keys held in memory only: their file had no room (or could not be opened);
        #: the next rewrite of the file gives them a place.
        self._unstored: set[str] = set()
        #: Why the last write of dirty values failed; None once one succeeds.
        self._write_error: OSError | None = None
        self._fd, self._capacity, data = self._open(filename)
        try:
            found = existing_values(data)
        except Exception:  # bytes left by someone else: start empty
            found = {}
        self._positions = {k: pos for k, (pos, _, _) in found.items()}
        self._values = {k: (v, ts) for k, (_, v, ts) in found.items()}
        #: Keys whose value changed since it was last written (the writer adds after
        #: storing the value; the thread pops before reading it, so none is lost).
        self._dirty: set[str] = set()
        self._used = max((pos + 16 for pos in self._positions.values()), default=8)
        self._identity = (-1, -1)
        if found:
            self._image = bytearray(data[:self._used])
        else:
            self._image = bytearray(INT.pack(8) + bytes(4))
        try:
            if self._fd >= 0:
                if not found:
                    os.pwrite(self._fd, bytes(self._image), 0)
                self._identity = identity(os.fstat(self._fd))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
            WATCHER.note("series_unstored", filename, e)
        WATCHER.add(self)

    @staticmethod
    def _open(filename: str) -> tuple[int, int, bytes]:
        """(fd, capacity, bytes used) of the file, or no file (-1) when it cannot be
        opened: the process keeps its values in memory and the watcher retries."""
        try:
            fd, capacity = open_reserved(filename)
        except OSError as e:
            WATCHER.note("series_unstored", filename, e)
            return -1, INITIAL_SIZE, b""
        try:
            return fd, capacity, read_used(fd, capacity)
        except OSError:
            return fd, capacity, b""

    @property
    def path(self) -> str:
        return self._path

    def read_value(self, key: str) -> tuple[float, float]:
        with self._lock:
            if key not in self._values:
                self._values[key] = (0.0, 0.0)
                self._add(key, 0.0, 0.0)
            return self._values[key]

    def write_value(self, key: str, value: float, timestamp: float) -> None:
        if key in self._positions:  # the engine's path: no lock, no system call
            self._values[key] = (value, timestamp)
            self._dirty.add(key)
            return
        with self._lock:
            if key in self._positions:
                self._values[key] = (value, timestamp)
                self._dirty.add(key)
            elif key in self._unstored:
                self._values[key] = (value, timestamp)  # in memory until a rewrite
            else:
                self._values[key] = (value, timestamp)
                self._add(key, value, timestamp)

    def flush(self) -> None:
        """Write every value updated since the last flush. A failed write keeps them
        dirty (the next round tries again; the watcher repairs a damaged file). In a
        forked child it does nothing: the file is the parent's, which writes newer
        values to it."""
        if self._pid != os.getpid():
            return
        with self._lock:
            if self._fd >= 0 and self._dirty:
                self._write_dirty()

    def _write_dirty(self) -> None:
        """Move the dirty values into the image and write them (lock held)."""
        keys = self._take_dirty()
        spans: list[list[int]] = []
        for pos in sorted(self._positions[key] for key in keys):
            if spans and pos - spans[-1][1] <= _SPAN_GAP:
                spans[-1][1] = pos + 16
            else:
                spans.append([pos, pos + 16])
        try:
            with memoryview(self._image) as image:
                for start, end in spans:
                    os.pwrite(self._fd, image[start:end], start)
        except OSError as e:
            # No room where a truncated file lost its blocks, or EIO: the values
            # stay dirty, and the watcher rewrites the file (or says why it cannot).
            self._dirty.update(keys)
            self._write_error = e
        else:
            self._write_error = None

    def _take_dirty(self) -> list[str]:
        """Pop the dirty keys and pack their latest values into the image (lock held)."""
        keys: list[str] = []
        pop, values, positions, image = self._dirty.pop, self._values, self._positions, \
            self._image
        while True:
            try:
                key = pop()
            except KeyError:
                return keys
            TWO_DOUBLES.pack_into(image, positions[key], *values[key])
            keys.append(key)

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._closed = True
            if self._fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = -1
        WATCHER.discard(self)

    def place_unstored(self) -> None:
        """Try again to give the series held in memory only their place in the file
        (the watcher, once a second; a failure was counted when the series came)."""
        with self._lock:
            for key in sorted(self._unstored):
                if self._fd < 0 or not self._add(key, *self._values[key], count=False):
                    return
                self._unstored.discard(key)

    def _add(self, key: str, value: float, timestamp: float, count: bool = True) -> bool:
        """Write a new key with its value at the end of the file (lock held). When the
        file cannot take it (no room, no file) nothing of the file's state changes: the
        key is held in memory only, counted and logged, until a rewrite places it."""
        new = entry(key, value, timestamp)
        used = self._used + len(new)
        try:
            if self._fd < 0:
                raise OSError(errno.EBADF, "the file could not be opened")
            capacity = self._capacity
            while used > capacity:
                capacity *= 2
            if capacity > self._capacity:
                reserve(self._fd, self._capacity, capacity)
                self._capacity = capacity
            os.pwrite(self._fd, new, self._used)
            os.pwrite(self._fd, INT.pack(used), 0)
        except OSError as e:
            self._unstored.add(key)
            if count:
                WATCHER.note("series_unstored", self._path, e)
            return False
        self._image += new
        self._image[0:4] = INT.pack(used)
        self._positions[key] = used - 16
        self._used = used
        return True

    def damage(self) -> str | None:
        """What was done to the file since this process wrote it, or None."""
        with self._lock:
            if self._closed:
                return None
            if self._fd < 0:
                return "unopened"
            if self._write_error is not None:
                return "unwritable"
            try:
                on_disk = os.stat(self._path, follow_symlinks=False)
            except FileNotFoundError:
                return "deleted"
            except OSError:
                return None  # cannot tell (the directory unreadable): the next check will
            try:
                own = os.fstat(self._fd)
                if identity(on_disk) != self._identity:
                    return "replaced"
                if own.st_size < self._capacity:
                    return "truncated"
                if os.pread(self._fd, self._used, 0) != self._image:
                    return "overwritten"  # anywhere in what was written, not only the header
            except OSError:
                return None
            return None

    def rewrite(self) -> bool:
        """Write every value held into a new file at the path (made next to it, then
        renamed over it) and write to that file from now on: True; False when there is
        nothing to rewrite (closed, or the process retired); OSError leaves the current
        one in use."""
        with self._lock:
            if self._closed or WATCHER.retired:  # a file removed on purpose stays removed
                return False
            keys = self._take_dirty()
            image, placed = self._with_unstored()
            directory, name = os.path.split(self._path)
            temporary = os.path.join(directory, f".{name}.{os.getpid()}.new")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)  # made new: nothing planted there is written through
            try:
                fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644)
            except OSError:
                self._dirty.update(keys)
                raise
            try:
                capacity = self._capacity
                while len(image) > capacity:
                    capacity *= 2
                reserve(fd, 0, capacity)
                os.pwrite(fd, bytes(image), 0)
                os.rename(temporary, self._path)
            except OSError:
                self._dirty.update(keys)
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
            old, self._fd = self._fd, fd
            self._capacity, self._image, self._used = capacity, image, len(image)
            self._positions.update(placed)
            self._unstored.difference_update(placed)
            self._write_error = None
            with contextlib.suppress(OSError):
                self._identity = identity(os.fstat(fd))
            if old >= 0:
                with contextlib.suppress(OSError):
                    os.close(old)
            return True

    def wait_for_rewrite(self) -> None:
        """Return once no rewrite of this file is in progress."""
        with self._lock:
            pass

    def _with_unstored(self) -> tuple[bytearray, dict[str, int]]:
        """The image with the keys held in memory only appended, and their places."""
        image = bytearray(self._image)
        placed: dict[str, int] = {}
        for key in sorted(self._unstored):
            image += entry(key, *self._values[key])
            placed[key] = len(image) - 16
        image[0:4] = INT.pack(len(image))
        return image, placed


def flush() -> None:
    """Write every value this process updated and has not written yet (a clean
    shutdown, and tests that read a file right after an update; the thread does it
    every :data:`~kvmetrics.exporters.value_watcher.FLUSH_INTERVAL_S` and at exit)."""
    WATCHER.flush()


def retire() -> None:
    """This process has marked itself dead: its files are no longer repaired."""
    WATCHER.retire()


def reserve_multiprocess_space() -> None:
    """Make every value file this process creates from now on a :class:`ValueFile`.

    Files opened before (by metrics created earlier in the process) keep the library's
    class; the exporter calls this before it creates any metric.
    """
    if values.MmapedDict is MmapedDict:
        values.MmapedDict = ValueFile  # type: ignore[misc,assignment]  # replaced on purpose
