"""Multiprocess files whose space is reserved before it is written: ENOSPC, not SIGBUS.

prometheus-client keeps a process's values in ``*.db`` files it maps into memory. It
makes a file (and later doubles it) with ``truncate``, which allocates nothing, then
writes through the mapping. On a full filesystem (a small tmpfs is the usual
``PROMETHEUS_MULTIPROC_DIR``) the first write to a page with no block behind it is a
SIGBUS: the process dies with exit 135 and no message, and inside vLLM that process is
the EngineCore.

:class:`ReservedMmapedDict` allocates every byte with ``posix_fallocate`` before the
library maps it, so a full filesystem is an ``OSError`` at the moment a file is made
or grown (when a new series is created), which the exporter catches: the new series
is dropped and counted, the ones that already have their place keep counting.

The files are per process and shared by every metric of that process (vLLM's own
too), so the reservation has to happen where the library creates them:
:func:`reserve_multiprocess_space` points prometheus-client's file class at this
subclass, once. It changes nothing else: same format, same names, same growth.
"""

from __future__ import annotations

import contextlib
import os

from prometheus_client import values
from prometheus_client.mmap_dict import MmapedDict

#: The size prometheus-client gives a new file (``mmap_dict._INITIAL_MMAP_SIZE``).
_INITIAL_SIZE = 1 << 16


def _entry_size(key: str) -> int:
    """Bytes one new value takes in a file: a 4-byte length, the key padded so that
    the two doubles after it are 8-byte aligned, and those two doubles."""
    n = len(key.encode("utf-8"))
    return 4 + n + (8 - (n + 4) % 8) + 16


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


class ReservedMmapedDict(MmapedDict):
    """prometheus-client's value file, with its space allocated before it is mapped."""

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        if not read_mode:
            _reserve_file(filename)
        super().__init__(filename, read_mode)

    def _init_value(self, key: str) -> None:
        capacity = self._capacity
        while self._used + _entry_size(key) > capacity:
            capacity *= 2
        if capacity > self._capacity:
            _reserve(self._f.fileno(), self._capacity, capacity)
        super()._init_value(key)


def _reserve_file(filename: str) -> None:
    """Give ``filename`` (new, or left by an earlier process with our pid) real blocks
    for its whole mapped size. A file this call made and could not fill is removed: an
    empty ``*.db`` left behind would fail every scrape of prometheus-client's own
    collector (vLLM's ``/metrics``)."""
    fd = os.open(filename, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            _reserve(fd, 0, max(size, _INITIAL_SIZE))
        except OSError:
            if size == 0:
                with contextlib.suppress(OSError):
                    os.unlink(filename)
            raise
    finally:
        os.close(fd)


def reserve_multiprocess_space() -> None:
    """Make every value file this process creates from now on a :class:`ReservedMmapedDict`.

    Files opened before (by metrics created earlier in the process) keep the library's
    class; the exporter calls this before it creates any metric.
    """
    if values.MmapedDict is MmapedDict:
        values.MmapedDict = ReservedMmapedDict  # type: ignore[misc]  # replaced on purpose
