"""What a process holds, read from ``/proc`` (Linux): its inet sockets, threads and
children, and whether it still runs. For tests that check where work happens."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_gone(pid: int, timeout: float) -> bool:
    """Poll until ``pid`` no longer runs; False if it still does after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill(pid: int) -> None:
    """SIGKILL ``pid`` if it runs, and wait for it to go."""
    if running(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        wait_gone(pid, 30)


def children(pid: int) -> list[int]:
    """The running processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return sorted(found)


def threads(pid: int) -> set[int]:
    return {int(t) for t in os.listdir(f"/proc/{pid}/task")}


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def inet_sockets(pid: int) -> list[tuple[int, str]]:
    """(local port, TCP state in hex: ``0A`` is LISTEN) of each TCP socket ``pid`` holds."""
    mine = _socket_inodes(pid)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in mine:
                found.append((int(fields[1].rpartition(":")[2], 16), fields[3]))
    return sorted(found)


def listening_ports(pid: int) -> list[int]:
    return [port for port, state in inet_sockets(pid) if state == "0A"]
