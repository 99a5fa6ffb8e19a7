"""Files a user names, read and written so that no path can hang, exhaust or destroy.

Every file kvmetrics writes (``--output``, ``--report``, soak reports, the vLLM
port file) and every file it reads (traces, fault plans, run and soak JSON) goes
through here, because a path is untrusted input too: run as root, as in most
containers, an output named ``/dev/null`` (or a ``mknod`` copy of it) would be
replaced by a regular file; a trace that is ``/dev/zero`` or a FIFO would exhaust
memory or block forever.

Writing: only a regular file or a new path is written, never a directory, device,
FIFO or socket; a symbolic link is followed to the file it names (the link stays),
except where the caller says ``no_follow`` (a file written by a process that runs as
root, in a directory others may write, as the vLLM port file: a link planted at its
name, or a file another user owns there, is refused, never followed or replaced).
The text goes to a temp file created exclusively (``O_EXCL``, random name) next to
the target, then renamed over it, so a failed write never truncates an old result
and a planted link at a predictable temp name cannot redirect the write. An existing
file keeps its mode (and, where the process may, its owner). A file with more than
one hard link is refused: the rename would give only this name the new text and
leave the other names on the old one, silently.

Reading: a file is opened with ``O_NONBLOCK`` (a FIFO opens at once instead of
waiting for a writer), must be a regular file, and is refused above a size cap.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from typing import BinaryIO

#: The largest file read whole (run JSON, soak reports, fault plans): far above what
#: kvmetrics writes (a 10,000-step run is a few MB), far below what would exhaust memory
#: once parsed (JSON takes several times its size as Python objects).
MAX_INPUT_BYTES = 256 * 2**20


class FileRefused(ValueError):
    """A path that is not read or written; the message is one line naming it."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def _existing(path: str, target: str, no_follow: bool = False) -> os.stat_result | None:
    """The stat of what ``target`` names (None if nothing), refused if it is not a
    regular file with one link (with ``no_follow``: nor a link, nor another user's)."""
    try:
        st = os.lstat(target) if no_follow else os.stat(target)
    except (FileNotFoundError, NotADirectoryError):
        return None  # a new file (or a parent that is not a directory: said next)
    except OSError as e:
        raise FileRefused(f"cannot inspect {path}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise FileRefused(f"{path} is a symbolic link (refused: it is written only as a "
                          "file of its own, never through a link)")
    if stat.S_ISDIR(st.st_mode):
        raise FileRefused(f"{path} is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(f"{path} is a {_kind(st.st_mode)}, not a regular file "
                          "(refused: writing would replace it)")
    if st.st_nlink > 1:
        raise FileRefused(f"{path} has {st.st_nlink} hard links: writing would give only "
                          "this name the new content (remove it or pick another path)")
    if no_follow and st.st_uid != os.geteuid():
        raise FileRefused(f"{path} is owned by user {st.st_uid}, not by this process's user "
                          f"{os.geteuid()} (refused: writing would replace their file)")
    return st


def _target(path: str, no_follow: bool = False) -> tuple[str, str]:
    """The file a path names (symbolic links followed, but for the last component with
    ``no_follow``) and its directory."""
    if no_follow:
        parent = os.path.realpath(os.path.dirname(path) or ".")
        return os.path.join(parent, os.path.basename(path)), parent
    target = os.path.realpath(path)
    return target, os.path.dirname(target) or "."


def _parent_problem(path: str, parent: str) -> None:
    if not os.path.exists(parent):
        raise FileRefused(f"output directory {os.path.dirname(path) or parent} does not exist")
    if not os.path.isdir(parent):
        raise FileRefused(f"{os.path.dirname(path) or parent} is not a directory")


def _create_temp(parent: str, name: str) -> tuple[int, str]:
    """A new file next to the target, created exclusively (never through a link); the
    kernel applies the umask to 0o666, as for a plain ``open(path, "w")``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(16):
        tmp = os.path.join(parent, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise OSError(errno.EEXIST, "no free temp file name", parent)


def check_output_path(path: str) -> str | None:
    """The one-line problem with writing ``path``, or None: checked before any work, by
    creating (and removing) a temp file where the output will go, so that a read-only
    filesystem or ``/proc`` is refused before a run, not after it."""
    try:
        target, parent = _target(path)
        _existing(path, target)
        _parent_problem(path, parent)
    except FileRefused as e:
        return str(e)
    try:
        fd, tmp = _create_temp(parent, os.path.basename(target))
    except OSError as e:
        return f"cannot write in {os.path.dirname(path) or parent}: {e.strerror}"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    return None


def write_file(path: str, data: str | bytes, no_follow: bool = False) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` atomically (see the module docstring).

    Raises :class:`FileRefused` for a path that must not be written and ``OSError`` for
    a write that failed (a full disk); the old file is then untouched. ``no_follow``:
    a link at ``path`` or a file there owned by another user is refused; the rename
    replaces the name itself, so a link planted after the check is replaced, never
    followed."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    target, parent = _target(path, no_follow)
    old = _existing(path, target, no_follow)
    _parent_problem(path, parent)
    fd, tmp = _create_temp(parent, os.path.basename(target))
    try:
        with os.fdopen(fd, "wb") as handle:
            if old is not None:
                os.fchmod(handle.fileno(), stat.S_IMODE(old.st_mode))
                # Not ours to give away (not root): the file becomes the writer's.
                with contextlib.suppress(OSError):
                    os.fchown(handle.fileno(), old.st_uid, old.st_gid)
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())  # a full disk fails here, not after the rename
        # Checked again just before the rename: the run took a while.
        _existing(path, target, no_follow)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def open_regular(path: str, what: str = "", limit: int = MAX_INPUT_BYTES) -> BinaryIO:
    """``path`` opened for binary reading if it is a regular file of at most ``limit``
    bytes; otherwise :class:`FileRefused` (``what`` names the file in the message:
    "trace" gives "cannot read trace PATH: ...")."""
    label = f"{what} {path}" if what else str(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise FileRefused(f"cannot read {label}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(f"cannot read {label}: a {_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise FileRefused(f"cannot read {label}: {st.st_size:,} bytes, over the limit of "
                              f"{limit:,}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str, what: str = "", limit: int = MAX_INPUT_BYTES) -> bytes:
    """A whole regular file, at most ``limit`` bytes (a file that grows while it is read,
    or lies about its size as ``/proc`` files do, is cut off and refused). Read in
    steps of the size it claims, then of a megabyte: never a buffer of ``limit``
    bytes for a small file."""
    with open_regular(path, what, limit) as handle:
        parts = [handle.read(min(os.fstat(handle.fileno()).st_size, limit) + 1)]
        total = len(parts[0])
        while parts[-1] and total <= limit:
            parts.append(handle.read(min(2**20, limit + 1 - total)))
            total += len(parts[-1])
        data = b"".join(parts)
    if len(data) > limit:
        label = f"{what} {path}" if what else str(path)
        raise FileRefused(f"cannot read {label}: over the limit of {limit:,} bytes")
    return data


def read_text(path: str, what: str = "", limit: int = MAX_INPUT_BYTES) -> str:
    """A whole regular file as UTF-8 text; anything else is one :class:`FileRefused` line."""
    data = read_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        label = f"{what} {path}" if what else str(path)
        raise FileRefused(f"{label}: not UTF-8 text (byte {e.start})") from None
