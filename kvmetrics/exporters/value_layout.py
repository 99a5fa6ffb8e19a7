"""The byte layout of prometheus-client's multiprocess value files, and their space.

A file is a 4-byte count of the bytes used, 4 bytes of padding, then one entry per
series: a 4-byte key length, the UTF-8 key padded so that what follows is 8-byte
aligned, and two doubles (value, timestamp). Every byte a writer may store into is
allocated with ``posix_fallocate`` first, so a full filesystem is an ``OSError`` when
room is asked for, never a fault later.
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct

#: The size prometheus-client gives a new file (``mmap_dict._INITIAL_MMAP_SIZE``).
INITIAL_SIZE = 1 << 16
INT = struct.Struct("i")  # native, as prometheus-client writes it
TWO_DOUBLES = struct.Struct("dd")


def entry(key: str, value: float = 0.0, timestamp: float = 0.0) -> bytes:
    """One new value as the library lays it out: a 4-byte length, the key padded so
    that the two doubles after it are 8-byte aligned, and those two doubles."""
    encoded = key.encode("utf-8")
    padded = encoded + b" " * (8 - (len(encoded) + 4) % 8)
    return INT.pack(len(encoded)) + padded + TWO_DOUBLES.pack(value, timestamp)


def reserve(fd: int, start: int, end: int) -> None:
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


def existing_values(data: bytes) -> dict[str, tuple[int, float, float]]:
    """The (position, value, timestamp) of each key in a file left by an earlier
    process with this pid; empty when its bytes are not a value file."""
    found: dict[str, tuple[int, float, float]] = {}
    used = INT.unpack_from(data)[0] if len(data) >= 8 else 0
    if used < 8 or used > len(data):
        return {}
    pos = 8
    while pos < used:
        n = INT.unpack_from(data, pos)[0] if pos + 4 <= used else -1
        end = pos + 4 + n + (8 - (n + 4) % 8) + 16
        if n <= 0 or end > used:
            return {}
        try:
            key = data[pos + 4:pos + 4 + n].decode("utf-8")
        except UnicodeDecodeError:
            return {}
        found[key] = (end - 16, *TWO_DOUBLES.unpack_from(data, end - 16))
        pos = end
    return found


def identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


#: The largest file left at this process's own name that is taken over as it is: the
#: library's files stay far under it (a series is well under 1 KiB); anything bigger
#: is not a file this process could have written, and is made anew.
MAX_REUSED_SIZE = 1 << 26

_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _remove(filename: str) -> None:
    """Take away whatever is at ``filename`` (a file, a FIFO, a link, an empty directory)."""
    try:
        os.unlink(filename)
    except IsADirectoryError:
        os.rmdir(filename)
    except PermissionError:  # Linux says EPERM, not EISDIR, for unlink of a directory
        if not os.path.isdir(filename) or os.path.islink(filename):
            raise
        os.rmdir(filename)


def _open_own(filename: str) -> int:
    """An fd of a regular file of ours at ``filename`` (one link, at most
    MAX_REUSED_SIZE bytes): the one there if it is such a file (an earlier process
    with our pid left it), else a new one in its place (anything else there, a hard
    link to another file of ours included, is removed, never read or written)."""
    try:
        fd = os.open(filename, _FLAGS)
    except FileNotFoundError:
        return os.open(filename, _FLAGS | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:  # a directory, a socket, a symlink (ELOOP): not ours to use
        _remove(filename)
        return os.open(filename, _FLAGS | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1 \
                and st.st_size <= MAX_REUSED_SIZE:  # a hard link: another file of ours
            return fd
    except OSError:
        os.close(fd)
        raise
    os.close(fd)
    _remove(filename)
    return os.open(filename, _FLAGS | os.O_CREAT | os.O_EXCL, 0o644)


def open_reserved(filename: str) -> tuple[int, int]:
    """Open ``filename`` (new, or a regular file of ours left by an earlier process
    with our pid) with real blocks for its whole size: (fd, size). A file this call
    made and could not fill is removed: an empty ``*.db`` left behind would fail every
    scrape of prometheus-client's own collector (vLLM's ``/metrics``)."""
    fd = _open_own(filename)
    size = 0
    try:
        size = os.fstat(fd).st_size
        capacity = max(size, INITIAL_SIZE)
        reserve(fd, 0, capacity)
    except OSError:
        os.close(fd)
        if size == 0:
            with contextlib.suppress(OSError):
                os.unlink(filename)
        raise
    return fd, capacity


def read_used(fd: int, size: int) -> bytes:
    """The bytes of ``fd`` its header says are used, never more than ``size``."""
    head = os.pread(fd, 8, 0)
    claimed = INT.unpack_from(head)[0] if len(head) >= 8 else 0
    return os.pread(fd, min(max(claimed, 0), size), 0)
