"""The multiprocess directory as an untrusted input: a file with more series than a
scrape may read, a live ``*.db`` file truncated or replaced under its writer (it died
with SIGBUS, exit 135 and no message), and the directory deleted and made again (every
series vanished while the target reported up)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from kvmetrics.exporters import mpfiles
from kvmetrics.exporters import multiprocess as mp
from kvmetrics.metrics import catalogue as cat

REPO = Path(__file__).resolve().parent.parent
#: A pid no test process has (under Linux's limit, above the busy low range).
DEAD_PID = 4_100_000


def _env(mpdir: Path) -> dict[str, str]:
    return {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mpdir),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                        os.environ.get("PYTHONPATH")]))}


def _value_file(keys: list[str], value: float = 1.0) -> bytes:
    """A value file as prometheus-client writes it, every key set to ``value``."""
    entries = []
    for key in keys:
        encoded = key.encode()
        padded = encoded + b" " * (8 - (len(encoded) + 4) % 8)
        entries.append(struct.pack("i", len(encoded)) + padded + struct.pack("dd", value, 0.0))
    body = b"".join(entries)
    return struct.pack("i", 8 + len(body)) + bytes(4) + body


def _counter_keys(family: str, n: int) -> list[str]:
    return [json.dumps([family, f"{family}_total", {"i": str(i)}, "h"], sort_keys=True)
            for i in range(n)]


def _errors(page: str, reason: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(page) for s in f.samples
               if s.name == cat.SCRAPE_ERRORS.name and s.labels.get("reason") == reason)


@pytest.fixture
def mpdir(tmp_path: Path) -> Path:
    path = tmp_path / "multiproc"
    path.mkdir()
    return path


# -- bounded work per scrape ----------------------------------------------------------------

def test_a_file_with_more_series_than_a_scrape_reads_is_skipped_the_rest_served(
        mpdir: Path, tmp_path: Path) -> None:
    """60,000 valid series in one file under the size cap (800,000 took 14-29 s and a
    gigabyte a scrape): left out, counted, and the engine's own series served."""
    (mpdir / f"counter_{DEAD_PID}.db").write_bytes(_value_file(_counter_keys("flood", 60_000)))
    (mpdir / f"counter_{DEAD_PID + 1}.db").write_bytes(
        _value_file(_counter_keys("fine", 3), value=7.0))
    out = tmp_path / "page.txt"
    render = subprocess.run([sys.executable, "-m", "tests.helpers.mp_worker", "render",
                             str(out)], cwd=REPO, env=_env(mpdir), capture_output=True,
                            text=True, timeout=120)
    assert render.returncode == 0, render.stderr[-2000:]
    page = out.read_text()
    assert "flood_total" not in page
    assert 'fine_total{i="2"} 7.0' in page
    assert _errors(page, "multiprocess_file_over_budget") == 1
    assert _errors(page, "unreadable_multiprocess_file") == 0
    said = [line for line in render.stderr.splitlines() if "skipping multiprocess" in line]
    assert len(said) == 1 and f"counter_{DEAD_PID}.db" in said[0], render.stderr[-2000:]


def _collector(mpdir: Path, budget: mpfiles.ScrapeBudget,
               skipped: list[str]) -> mp.TolerantMultiProcessCollector:
    return mp.TolerantMultiProcessCollector(
        str(mpdir), lambda path: pytest.fail(f"unreadable {path}"),
        on_over_budget=lambda path: skipped.append(os.path.basename(path)), budget=budget)


def _names(collector: mp.TolerantMultiProcessCollector) -> set[str]:
    return {m.name for m in collector.collect()}


def test_each_bound_of_the_budget_leaves_out_files_not_the_page(
        mpdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()  # files of a live process: read on every scrape
    (mpdir / f"counter_{me}.db").write_bytes(_value_file(_counter_keys("a", 40)))
    (mpdir / f"histogram_{me}.db").write_bytes(_value_file(_counter_keys("b", 400)))
    skipped: list[str] = []
    # Series: the page holds at most 100, so the 400-series file is left out.
    collector = _collector(mpdir, mpfiles.ScrapeBudget(max_series=100), skipped)
    monkeypatch.setattr(os, "getpid", lambda: 1)  # neither file is "this process's own"
    assert _names(collector) == {"a"} and skipped == [f"histogram_{me}.db"]
    # Parsed once: while its bytes stay the same it is refused unparsed.
    parsed: list[int] = []
    real_parse = mp.parse_entries

    def counting_parse(data: bytes, *args, **kwargs):  # type: ignore[no-untyped-def]
        parsed.append(len(data))
        return real_parse(data, *args, **kwargs)

    monkeypatch.setattr(mp, "parse_entries", counting_parse)
    assert _names(collector) == {"a"} and parsed == []
    # Bytes: the first file fits, the second would pass what is left.
    skipped.clear()
    size_a = (mpdir / f"counter_{me}.db").stat().st_size
    collector = _collector(mpdir, mpfiles.ScrapeBudget(max_bytes=size_a + 100), skipped)
    assert _names(collector) == {"a"} and skipped == [f"histogram_{me}.db"]
    # Time: none left, every file but this process's own is left out.
    skipped.clear()
    collector = _collector(mpdir, mpfiles.ScrapeBudget(max_seconds=-1.0), skipped)
    assert _names(collector) == set() and len(skipped) == 2
    monkeypatch.setattr(os, "getpid", lambda: me)  # now they are this process's own
    assert _names(_collector(mpdir, mpfiles.ScrapeBudget(max_seconds=-1.0), skipped)) == \
        {"a", "b"}


# -- a writer whose files are damaged -------------------------------------------------------

_WRITER = """
import sys
from kvmetrics.exporters import mmap_space
from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.metrics import catalogue as cat
sink = PrometheusSink()
common = ("m", "0")
sink.inc(cat.PREEMPTIONS, common, 1)
sink.set(cat.KV_CACHE_BLOCKS, common, 77)
mmap_space.flush()
print("ready", flush=True)
for line in sys.stdin:
    if line.startswith("inc"):
        for _ in range(int(line.split()[1])):
            sink.inc(cat.PREEMPTIONS, common, 1)
        if "noflush" not in line:
            mmap_space.flush()
        print("written", flush=True)
    elif line.startswith("render"):
        open(line.split()[1], "wb").write(sink.render())
        print("rendered", flush=True)
"""


class Writer:
    """A process writing kvmetrics values to ``mpdir``; a crash shows in its exit code."""

    def __init__(self, mpdir: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _WRITER], cwd=REPO,
                                     env=_env(mpdir), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.said() == "ready"

    def said(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line:
            _, err = self.proc.communicate(timeout=30)
            raise AssertionError(f"writer exited {self.proc.returncode}: {err[-2000:]}")
        return line

    def tell(self, line: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.said()

    def finish(self) -> str:
        """Its stderr, after it exits cleanly (told to by the end of its input)."""
        _, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, (self.proc.returncode, err[-2000:])
        return err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def _served(mpdir: Path) -> dict[str, float]:
    """What a reader finds in ``mpdir`` now: kvmetrics sample name -> value."""
    try:
        metrics = mp.TolerantMultiProcessCollector(str(mpdir), lambda path: None).collect()
    except Exception:
        return {}
    return {s.name: s.value for m in metrics for s in m.samples
            if s.name in (cat.PREEMPTIONS.name, cat.KV_CACHE_BLOCKS.name)}


def _until(check, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    return check()


@pytest.mark.parametrize("damage", ["truncate", "replace"])
def test_a_live_file_truncated_or_replaced_is_rewritten_not_a_sigbus(
        mpdir: Path, tmp_path: Path, damage: str) -> None:
    writer = Writer(mpdir)
    try:
        counter = next(mpdir.glob("counter_*.db"))
        if damage == "truncate":
            os.truncate(counter, 0)
        else:
            (mpdir / "x.new").write_bytes(b"\x10\x00\x00\x00" + bytes(100))
            os.rename(mpdir / "x.new", counter)
        assert writer.tell("inc 1000") == "written"  # it died here: SIGBUS, exit 135
        expected = {cat.PREEMPTIONS.name: 1001.0, cat.KV_CACHE_BLOCKS.name: 77.0}
        assert _until(lambda: _served(mpdir) == expected) is True, _served(mpdir)
        assert writer.tell(f"render {tmp_path / 'page.txt'}") == "rendered"
        assert writer.tell("inc 1") == "written"
        assert _served(mpdir)[cat.PREEMPTIONS.name] == 1002.0
        err = writer.finish()
    finally:
        writer.kill()
    page = (tmp_path / "page.txt").read_text()
    assert _errors(page, "multiprocess_file_rewritten") == 1
    said = [line for line in err.splitlines() if "multiprocess value files" in line]
    what = "truncated" if damage == "truncate" else "replaced by another file"
    assert len(said) == 1 and what in said[0] and "rewrote 1 file" in said[0], err[-2000:]


def test_a_directory_deleted_and_made_again_gets_every_value_back(
        mpdir: Path, tmp_path: Path) -> None:
    """The writer is idle (no update after the directory is made again): its values
    come back anyway, within about a second."""
    writer = Writer(mpdir)
    try:
        before = _served(mpdir)
        assert before == {cat.PREEMPTIONS.name: 1.0, cat.KV_CACHE_BLOCKS.name: 77.0}
        mpdir.rename(tmp_path / "gone")  # at once, not file by file under the watcher
        shutil.rmtree(tmp_path / "gone")
        mpdir.mkdir()
        assert _until(lambda: _served(mpdir) == before) is True, _served(mpdir)
        library = MultiProcessCollector.merge([str(p) for p in mpdir.glob("*.db")])
        assert {s.name: s.value for m in library for s in m.samples
                if s.name in before} == before  # vLLM's /metrics reads them as well
        assert writer.tell(f"render {tmp_path / 'page.txt'}") == "rendered"
        err = writer.finish()
    finally:
        writer.kill()
    page = (tmp_path / "page.txt").read_text()
    assert _errors(page, "multiprocess_file_rewritten") == 1
    said = [line for line in err.splitlines() if "multiprocess value files" in line]
    assert len(said) == 1 and "deleted and made again" in said[0], err[-2000:]
    assert not [p.name for p in mpdir.iterdir() if p.name.startswith(".")]  # no leftovers


# -- the flush: updates reach the files off the engine's thread ----------------------------

def test_an_update_reaches_the_file_within_a_few_flushes_without_an_explicit_one(
        mpdir: Path) -> None:
    writer = Writer(mpdir)
    try:
        assert writer.tell("inc 5 noflush") == "written"
        expected = {cat.PREEMPTIONS.name: 6.0, cat.KV_CACHE_BLOCKS.name: 77.0}
        # The writer's thread writes it within about FLUSH_INTERVAL_S; the deadline
        # only bounds a failure.
        assert _until(lambda: _served(mpdir) == expected) is True, _served(mpdir)
        writer.finish()
    finally:
        writer.kill()


_EXIT_WITHOUT_FLUSH = """
import multiprocessing, sys
from prometheus_client import Counter
from kvmetrics.exporters import mmap_space, value_watcher
value_watcher.FLUSH_INTERVAL_S = 3600.0  # the thread never flushes: only the exit does
mmap_space.reserve_multiprocess_space()
counter = Counter("exits", "h", ["who"])
counter.labels("parent").inc(0)  # the series exists in the file, its value in memory

def child():
    counter.labels("child").inc(0)
    counter.labels("child").inc(4)  # a forked child ends with os._exit: no atexit

process = multiprocessing.get_context("fork").Process(target=child)
process.start()
process.join()
counter.labels("parent").inc(3)
sys.exit(process.exitcode)
"""


def test_a_clean_exit_writes_every_update_a_forked_child_too(mpdir: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_FLUSH], cwd=REPO,
                          env=_env(mpdir), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    files = {p.name: p for p in mpdir.glob("counter_*.db")}
    assert len(files) == 2, files
    found: dict[str, float] = {}
    for path in files.values():  # each process's file holds both series: summed
        for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path)):
            if json.loads(key)[0] == "exits":
                who = json.loads(key)[2]["who"]
                found[who] = found.get(who, 0.0) + value
    assert found == {"parent": 3.0, "child": 4.0}


_FORK_AFTER_UPDATE = """
import multiprocessing
from prometheus_client import Counter
from kvmetrics.exporters import mmap_space, value_watcher
value_watcher.FLUSH_INTERVAL_S = 3600.0
mmap_space.reserve_multiprocess_space()
counter = Counter("forked", "h")
counter.inc(5)  # in memory, not yet written, when the child is forked
context = multiprocessing.get_context("fork")
go = context.Event()

def child():
    go.wait(30)
    counter.inc(1)  # the library first closes the parent's files in the child

process = context.Process(target=child)
process.start()
counter.inc(4)
mmap_space.flush()
go.set()
process.join()
"""


def test_a_forked_child_never_writes_its_parents_stale_values(mpdir: Path) -> None:
    """The child holds a copy of the parent's unwritten 5; the parent has since written
    9. Closing the parent's files in the child must not write the 5 over the 9."""
    done = subprocess.run([sys.executable, "-c", _FORK_AFTER_UPDATE], cwd=REPO,
                          env=_env(mpdir), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    by_file = {}
    for path in mpdir.glob("counter_*.db"):
        by_file[path.name] = [value for key, value, _, _ in
                              MmapedDict.read_all_values_from_file(str(path))
                              if json.loads(key)[0] == "forked"]
    assert sorted(by_file.values()) == [[1.0], [9.0]], by_file
