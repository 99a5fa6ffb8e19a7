"""The private directories of ``serve=process``: made unguessable, swept when left.

An engine with no ``PROMETHEUS_MULTIPROC_DIR`` of the user's writes its values to a
directory of its own in the temporary folder, which it or its exporter removes when
either ends. Only a death of both at once (a SIGKILL to the engine and everything below
it) leaves one behind; the next engine's start removes those.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile

from kvmetrics.exporters.multiprocess import process_alive

__all__ = ["pid_namespace", "private_multiprocess_dir", "remove_left_behind"]

#: A private directory's name: the engine's pid, its pid namespace (a pid means
#: something only in its own: containers that share a temporary folder do not share
#: pids), then mkdtemp's random part.
_PRIVATE_NAME = re.compile(r"kvmetrics-([0-9]{1,10})-([0-9]{1,20})-[a-z0-9_]{8}")
#: What prometheus-client and the exporter write there (``counter_1234.db``).
_VALUE_FILE = re.compile(r"[a-z_]{1,40}_[0-9]{1,10}\.db")
#: Entries of the temporary folder looked at, at most, for directories left behind.
_SWEEP_MAX_ENTRIES = 100_000


def private_multiprocess_dir() -> str:
    """A new directory only this user can enter (mode 0700), made by ``mkdir`` of a
    random name: nothing planted at a predictable name can be followed."""
    return tempfile.mkdtemp(prefix=f"kvmetrics-{os.getpid()}-{pid_namespace()}-")


def pid_namespace() -> int:
    """This process's pid namespace (its inode number), 0 where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def remove_left_behind(parent: str | None = None) -> int:
    """Remove the private directories of engines that died with their exporter; how many.

    vLLM ends an EngineCore by SIGKILL to it and every process below it (``vllm serve``'s
    shutdown does, after a SIGTERM it does not wait for), so neither side can remove the
    directory then: the next engine to start does. A directory goes only when it is
    unmistakably one of these: its name, a real directory (not a link) of this user with
    mode 0700, made in this pid namespace by an engine whose pid is gone, and nothing in
    it but value files. Anything else is left as it is."""
    parent = parent or tempfile.gettempdir()
    namespace = str(pid_namespace())
    removed = 0
    try:
        with os.scandir(parent) as entries:
            for count, entry in enumerate(entries):
                if count >= _SWEEP_MAX_ENTRIES:
                    break
                match = _PRIVATE_NAME.fullmatch(entry.name)
                if (match and namespace != "0" and match.group(2) == namespace
                        and not process_alive(int(match.group(1))) and _remove_if_ours(entry.path)):
                    removed += 1
    except OSError:  # an unreadable temporary folder: nothing to sweep here
        pass
    return removed


def _remove_if_ours(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) != 0o700:
            return False
        names = os.listdir(fd)
        if len(names) > 64 or not all(_VALUE_FILE.fullmatch(n) for n in names):
            return False
        for name in names:
            if not stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                return False
        for name in names:
            os.unlink(name, dir_fd=fd)
        os.rmdir(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
