"""This process's own value file under attack or failure, in process: what is planted
at its name is never trusted, and a write that fails never raises into the caller
(vLLM's metrics), never leaves a wrong value, and is counted."""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvmetrics.exporters import mmap_space, value_layout, value_watcher
from kvmetrics.exporters.mmap_space import ValueFile
from kvmetrics.exporters.value_layout import INITIAL_SIZE, existing_values


def _on_disk(path: Path) -> dict[str, float]:
    return {k: v for k, (_, v, _) in existing_values(path.read_bytes()).items()}


def _entries(values: dict[str, float]) -> bytes:
    body = b"".join(value_layout.entry(k, v) for k, v in values.items())
    return value_layout.INT.pack(8 + len(body)) + bytes(4) + body


@pytest.fixture(autouse=True)
def watcher(monkeypatch: pytest.MonkeyPatch) -> value_watcher.Watcher:
    """A watcher of these files alone whose thread does nothing: each test runs its
    rounds itself, so no background round races its assertions."""
    quiet = value_watcher.Watcher()
    monkeypatch.setattr(quiet, "_run", lambda: None)
    monkeypatch.setattr(mmap_space, "WATCHER", quiet)
    return quiet


@pytest.fixture
def events() -> Iterator[list[tuple[str, str]]]:
    """What the watcher tells its listeners (as the exporter hears it)."""
    heard: list[tuple[str, str]] = []

    def listener(what: str, where: str) -> None:
        heard.append((what, where))

    value_watcher.on_rewrite(listener)
    yield heard
    value_watcher._listeners[:] = [r for r in value_watcher._listeners if r() is not listener]


@pytest.fixture
def failing_writes(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Make ``os.pwrite`` fail (ENOSPC) for the writes ``when(fd, data, offset)`` picks."""
    real = os.pwrite

    def install(when: Callable[[int, bytes, int], bool]) -> None:
        def pwrite(fd: int, data: bytes, offset: int) -> int:
            if when(fd, data, offset):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, data, offset)
        monkeypatch.setattr(os, "pwrite", pwrite)
    install.restore = lambda: monkeypatch.setattr(os, "pwrite", real)  # type: ignore[attr-defined]
    return install


@pytest.mark.parametrize("planted", ["fifo", "directory", "huge", "lying_header",
                                     "foreign", "hard_link"])
def test_what_is_planted_at_the_files_name_is_replaced_not_used(
        tmp_path: Path, planted: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A FIFO or a directory there made metric creation raise; a huge file there was
    allocated whole and read into memory; a header claiming more than the file holds
    was read past its end."""
    path = tmp_path / "counter_4242.db"
    if planted == "fifo":
        os.mkfifo(path)
    elif planted == "directory":
        path.mkdir()
    elif planted == "huge":
        with open(path, "wb") as f:
            f.truncate(value_layout.MAX_REUSED_SIZE + 4096)  # sparse: no real blocks
    elif planted == "lying_header":
        path.write_bytes((1 << 30).to_bytes(4, "little") + bytes(4) + b"x" * 64)
    elif planted == "hard_link":  # another file of ours: never written through
        (tmp_path / "precious").write_bytes(b"keep")
        os.link(tmp_path / "precious", path)
    else:  # a value file of another user: its values are not ours to serve
        path.write_bytes(_entries({"k": 1.0, "planted": 5.0}))
        euid = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: euid + 1)
    f = ValueFile(str(path))
    f.write_value("k", 3.0, 0.0)
    f.flush()
    st = path.stat()
    assert path.is_file() and st.st_size == INITIAL_SIZE
    assert _on_disk(path) == {"k": 3.0}
    if planted == "hard_link":
        assert (tmp_path / "precious").read_bytes() == b"keep"
    f.close()


def test_a_half_failed_new_series_leaves_the_file_and_its_values_right(
        tmp_path: Path, failing_writes: Callable[..., None]) -> None:
    """The used count was advanced before the header write: when that failed, later
    series were placed wrong and a struct.error escaped into the caller."""
    path = tmp_path / "counter_4243.db"
    f = ValueFile(str(path))
    f.write_value("a", 1.0, 0.0)
    failing_writes(lambda fd, data, offset: offset == 0)  # the header write fails
    assert f.read_value("b") == (0.0, 0.0)  # no OSError into the caller
    failing_writes.restore()  # type: ignore[attr-defined]
    f.write_value("b", 2.0, 0.0)  # held in memory only, until a rewrite places it
    f.write_value("a", 5.0, 0.0)
    f.write_value("c", 7.0, 0.0)
    f.flush()
    assert _on_disk(path) == {"a": 5.0, "c": 7.0}
    f.rewrite()
    assert _on_disk(path) == {"a": 5.0, "c": 7.0, "b": 2.0}
    f.write_value("b", 9.0, 0.0)
    f.flush()
    assert _on_disk(path) == {"a": 5.0, "c": 7.0, "b": 9.0}
    f.close()


def test_a_series_without_room_is_kept_in_memory_counted_never_raised(
        tmp_path: Path, failing_writes: Callable[..., None],
        events: list[tuple[str, str]], watcher: value_watcher.Watcher) -> None:
    """A file that cannot be opened, or a new series it has no room for, raised OSError
    out of prometheus-client's labels() (vLLM's own metrics included)."""
    path = tmp_path / "gone" / "counter_4244.db"
    f = ValueFile(str(path))  # its directory does not exist
    f.write_value("a", 1.0, 0.0)
    assert f.read_value("a") == (1.0, 0.0)
    assert f.damage() == "unopened"
    path.parent.mkdir()
    f.rewrite()  # what the watcher does once a second
    assert _on_disk(path) == {"a": 1.0}
    failing_writes(lambda fd, data, offset: True)
    f.write_value("b", 2.0, 0.0)  # no room: no OSError
    watcher.check()  # still no room: kept in memory, not counted again
    assert _on_disk(path) == {"a": 1.0}
    failing_writes.restore()  # type: ignore[attr-defined]
    watcher._tell()
    assert [w for w, _ in events] == ["series_unstored", "series_unstored"]
    f.write_value("b", 3.0, 0.0)
    watcher.check()  # room again: the series gets its place
    assert _on_disk(path) == {"a": 1.0, "b": 3.0}
    f.close()


def test_a_file_that_refuses_every_write_is_rewritten_and_counted(
        tmp_path: Path, failing_writes: Callable[..., None],
        events: list[tuple[str, str]], watcher: value_watcher.Watcher) -> None:
    """Writes that kept failing on an intact file left it stale with nothing said."""
    path = tmp_path / "counter_4245.db"
    f = ValueFile(str(path))
    f.write_value("a", 1.0, 0.0)
    f.flush()
    failing_writes(lambda fd, data, offset: True)
    f.write_value("a", 2.0, 0.0)
    f.flush()
    assert f.damage() == "unwritable"
    watcher.check()  # the rewrite fails too: counted as a failure only
    assert [w for w, _ in events] == ["rewrite_failed"]
    failing_writes.restore()  # type: ignore[attr-defined]
    before = watcher.rewrites.get("unwritable", 0)
    watcher.check()
    assert [w for w, _ in events] == ["rewrite_failed", "unwritable"]
    assert watcher.rewrites["unwritable"] == before + 1
    assert f.damage() is None and _on_disk(path) == {"a": 2.0}
    f.close()


def test_no_repair_brings_a_file_back_once_the_process_is_retired(
        tmp_path: Path, watcher: value_watcher.Watcher) -> None:
    """A rewrite racing mark_process_dead brought back a live-gauge file removed on
    purpose."""
    path = tmp_path / "gauge_livesum_4246.db"
    f = ValueFile(str(path))
    f.write_value("g", 1.0, 0.0)
    f.flush()
    watcher.retire()
    path.unlink()  # what mark_process_dead does
    assert f.rewrite() is False  # a repair that was about to run
    assert not path.exists()
    watcher._repair([f], "deleted", str(path))  # nothing rewritten: nothing counted
    assert watcher.rewrites == {}
    f.close()


def test_the_process_is_marked_dead_when_its_last_sink_closes(tmp_path: Path) -> None:
    """Each sink had its own lifetime: the first of several sinks of one process to
    close marked the pid dead and removed the others' live-gauge files."""
    from kvmetrics.exporters.multiprocess import ProcessLifetime

    gauge = tmp_path / f"gauge_livesum_{os.getpid()}.db"
    gauge.write_bytes((8).to_bytes(4, "little") + bytes(4))
    first, second = ProcessLifetime(str(tmp_path)), ProcessLifetime(str(tmp_path))
    first.close()
    assert gauge.exists()
    second.close()
    assert not gauge.exists()


def test_a_value_overwritten_in_place_is_seen_and_rewritten(
        tmp_path: Path, watcher: value_watcher.Watcher) -> None:
    """Only the 4-byte header was compared: a value overwritten in place was served
    wrong for good."""
    path = tmp_path / "counter_4247.db"
    f = ValueFile(str(path))
    f.write_value("a", 1.0, 0.0)
    f.write_value("b", 2.0, 0.0)
    f.flush()
    position = existing_values(path.read_bytes())["b"][0]
    with open(path, "r+b") as planted:
        planted.seek(position)
        planted.write(struct.pack("d", 99.0))
    assert _on_disk(path)["b"] == 99.0
    assert f.damage() == "overwritten"
    watcher.check()
    assert f.damage() is None and _on_disk(path) == {"a": 1.0, "b": 2.0}
    f.close()


def test_a_file_whose_header_cannot_be_written_is_closed_and_retried(
        tmp_path: Path, failing_writes: Callable[..., None]) -> None:
    """A failed header write in the constructor raised into the caller and leaked the fd."""
    path = tmp_path / "counter_4248.db"
    fds = len(os.listdir("/proc/self/fd"))
    failing_writes(lambda fd, data, offset: True)
    f = ValueFile(str(path))
    failing_writes.restore()  # type: ignore[attr-defined]
    assert len(os.listdir("/proc/self/fd")) == fds
    f.write_value("a", 4.0, 0.0)
    assert f.damage() == "unopened"
    f.rewrite()
    assert _on_disk(path) == {"a": 4.0}
    f.close()
