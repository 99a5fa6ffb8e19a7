"""Multiprocess mode against a hostile or broken ``PROMETHEUS_MULTIPROC_DIR`` (issue 28,
cases 2, 12, 13, 14): a full filesystem, a file name whose pid overflows, a file whose
header claims 2 GB, thousands of dead processes' files, and the directory deleted while
the endpoint serves it."""

from __future__ import annotations

import http.client
import logging
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from kvmetrics.exporters import multiprocess as mp
from kvmetrics.exporters.admission import ServerLimits
from kvmetrics.exporters.prometheus import serve
from kvmetrics.metrics import catalogue as cat

REPO = Path(__file__).resolve().parent.parent


def _env(mpdir: Path | str) -> dict[str, str]:
    return {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mpdir),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                        os.environ.get("PYTHONPATH")]))}


def _python(mpdir: Path | str, *args: str, timeout: float = 120,
            **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=_env(mpdir),
                          capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def engine_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files one finished engine run leaves (counters, histograms), made once."""
    mpdir = tmp_path_factory.mktemp("engine")
    done = _python(mpdir, "-m", "tests.helpers.mp_worker", "run", "5", "31",
                   str(mpdir.parent / "engine.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    return mpdir


@pytest.fixture
def mpdir(tmp_path: Path, engine_files: Path) -> Path:
    path = tmp_path / "multiproc"
    shutil.copytree(engine_files, path)
    return path


def _page(mpdir: Path) -> str:
    out = mpdir.parent / "page.txt"
    render = _python(mpdir, "-m", "tests.helpers.mp_worker", "render", str(out))
    assert render.returncode == 0, render.stderr[-2000:]
    return out.read_text()


def _skipped(page: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(page) for s in f.samples
               if s.name == cat.SCRAPE_ERRORS.name
               and s.labels.get("reason") == "unreadable_multiprocess_file")


def _samples(metrics) -> set[tuple[str, tuple, float]]:
    return {(s.name, tuple(sorted(s.labels.items())), s.value)
            for m in metrics for s in m.samples}


def _dead_pids(n: int) -> list[int]:
    """``n`` pids no process has now (above the busy low range, under Linux's limit)."""
    pids = []
    for pid in range(4_000_000, 4_194_304):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            pids.append(pid)
            if len(pids) == n:
                return pids
        except OSError:
            pass
    raise AssertionError("no free pids")


# -- case 2: a full filesystem ------------------------------------------------------------

def _on_full_tmpfs(script: str, size: str = "1m", leave_kb: int = 0) -> list[str]:
    """Run ``script`` (sh) with $D a ``size`` tmpfs filled to ``leave_kb`` KB free, in a
    private mount namespace (it vanishes with the process)."""
    fill = "dd if=/dev/zero of=$D/fill bs=4k 2>/dev/null; "
    if leave_kb:
        fill += f"dd if=/dev/zero of=$D/fill bs=1k count=$(( $(df -k --output=size $D " \
                f"| tail -1) - {leave_kb} )) 2>/dev/null; "
    setup = f"export D=$(mktemp -d) && mount -t tmpfs -o size={size} tmpfs $D && {fill}"
    unshare = ["unshare", "--mount"] if os.geteuid() == 0 else \
        ["unshare", "--mount", "--map-root-user"]
    return [*unshare, "sh", "-c", setup + script]


def test_a_full_multiprocess_filesystem_keeps_new_series_in_memory_not_the_process(
        tmp_path: Path) -> None:
    """prometheus-client maps sparse files: on a full tmpfs its first write was a SIGBUS
    (exit 135, no message), which inside vLLM kills the EngineCore. Series with no room
    are kept in memory only, said in one line."""
    out = tmp_path / "run.json"
    command = _on_full_tmpfs(
        f"PROMETHEUS_MULTIPROC_DIR=$D exec {sys.executable} -m tests.helpers.mp_worker "
        f"run 7 41 {out}")
    done = subprocess.run(command, cwd=REPO, env=_env("unused"), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert out.exists()  # the engine ran to the end
    said = [line for line in done.stderr.splitlines() if "kept in memory only" in line]
    assert len(said) == 1, done.stderr[-2000:]
    assert "No space left on device" in said[0]


_GROW = """
import os, sys
from prometheus_client.mmap_dict import MmapedDict
from kvmetrics.exporters.mmap_space import ValueFile
path = os.path.join(os.environ["D"], "counter_1.db")
d = ValueFile(path)
written = 0
for i in range(100000):
    key = f"key-{i:06d}-" + "x" * 200
    d.write_value(key, float(i), 0.0)
    if key in d._unstored:
        print("unstored", written, d.read_value(key)[0], flush=True)
        break
    written += 1
d.close()
back = list(MmapedDict.read_all_values_from_file(path))
print("kept", len(back), back[-1][1] if back else None)
"""


def test_a_file_that_cannot_grow_keeps_the_series_in_memory_and_what_it_holds(
        tmp_path: Path) -> None:
    """Growing a value file (a new series once 64 KiB are used) on a full filesystem:
    the series is kept in memory (no OSError into the caller), the file untouched,
    every value written so far still readable."""
    command = _on_full_tmpfs(f"exec {sys.executable} -c '{_GROW}'", size="256k",
                             leave_kb=96)
    done = subprocess.run(command, cwd=REPO, env=_env("unused"), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    refused, kept = done.stdout.splitlines()
    _, written, held = refused.split()
    assert int(written) > 200  # no room after the first 64 KiB filled
    assert float(held) == float(written)  # its value held in memory all the same
    assert kept.split() == ["kept", written, f"{float(int(written) - 1)}"]


_SWITCH = """
import json, os, sys
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.mmap_dict import MmapedDict
from kvmetrics.exporters.prometheus_internals import switch_to_multiprocess_values
before = Counter("made_before", "in memory", registry=CollectorRegistry())
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
switch_to_multiprocess_values()
after = Counter("made_after", "in the files", registry=CollectorRegistry())
before.inc()
after.inc(3)
for name in sorted(os.listdir(sys.argv[1])):
    for entry in MmapedDict.read_all_values_from_file(os.path.join(sys.argv[1], name)):
        print(name.split("_")[0], json.loads(entry[0])[1], entry[1])
"""


def test_values_made_after_the_switch_go_to_the_shared_files(tmp_path: Path) -> None:
    """prometheus-client picks its value class once, at import: a process that imported
    it before the directory was set (a vLLM EngineCore) writes to the files only after
    the switch, and only what it makes from then on."""
    env = {k: v for k, v in _env(tmp_path).items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    done = subprocess.run([sys.executable, "-c", _SWITCH, str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "counter made_after_total 3.0" in done.stdout.splitlines(), done.stdout
    assert "made_before" not in done.stdout


# -- case 12: a pid no process can have ---------------------------------------------------

def test_a_pid_that_overflows_os_kill_a_fifo_and_a_link_are_skipped_files(mpdir: Path) -> None:
    gauge = next(iter(mpdir.glob("counter_*.db"))).read_bytes()
    (mpdir / "gauge_livesum_99999999999999999999.db").write_bytes(gauge)
    (mpdir / "notes.db").write_bytes(b"x")  # not the library's either
    os.mkfifo(mpdir / "counter_4000003.db")  # opening it to read would wait for a writer
    (mpdir / "counter_4000004.db").symlink_to("/dev/zero")
    page = _page(mpdir)  # creating the sink reaps: it raised OverflowError at start
    assert 'kvmetrics_preemptions_total{engine="5"' in page
    assert _skipped(page) == 4
    run = _python(mpdir, "-m", "kvmetrics", "run", "--max-requests", "3", "--verify", "off")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]


def test_a_file_name_cannot_forge_or_rewrite_a_log_line(mpdir: Path) -> None:
    """The error naming a skipped file carries the name as it is on disk; a name
    holding a line feed forged a second, official-looking log line, and an escape
    sequence or U+202E rewrote the one shown. Every kvmetrics logger escapes them."""
    name = "counter_1\nkvmetrics: all files fine\x1b[2J\u202e.db"
    (mpdir / name).write_bytes(b"x")
    out = mpdir.parent / "page.txt"
    render = _python(mpdir, "-m", "tests.helpers.mp_worker", "render", str(out))
    assert render.returncode == 0, render.stderr[-2000:]
    lines = [line for line in render.stderr.splitlines() if "skipping multiprocess" in line]
    assert len(lines) == 1, render.stderr[-2000:]
    assert "counter_1\\nkvmetrics: all files fine\\x1b[2J\\u202e.db" in lines[0]
    assert not any(line.startswith("kvmetrics: all files fine")
                   for line in render.stderr.splitlines())
    assert "\x1b" not in render.stderr and "\u202e" not in render.stderr


# -- case 13: a header that lies, and thousands of dead processes --------------------------

def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def test_a_header_claiming_2_gib_is_skipped_unread(mpdir: Path) -> None:
    """A sparse 2 GiB file whose header claims 2^31-1 bytes: read as is, 4.2 GB a scrape.
    The render runs under a 1 GiB address-space limit."""
    with open(mpdir / "counter_4000001.db", "wb") as f:
        f.write((2**31 - 1).to_bytes(4, sys.byteorder) + bytes(4))
        f.truncate(2**31)
    (mpdir / "histogram_4000002.db").write_bytes(  # claims more than it has
        (4096).to_bytes(4, sys.byteorder) + bytes(100))
    out = mpdir.parent / "page.txt"
    render = _python(mpdir, "-m", "tests.helpers.mp_worker", "render", str(out),
                     preexec_fn=_limit_memory)
    assert render.returncode == 0, render.stderr[-2000:]
    page = out.read_text()
    assert _skipped(page) == 2
    assert 'kvmetrics_preemptions_total{engine="5"' in page
    assert "header claims 2147483647 bytes" in render.stderr


def test_dead_processes_files_are_read_once_and_merged_as_the_library_does(
        mpdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = {p.name.split("_")[0]: p.read_bytes() for p in mpdir.glob("*.db")}
    for p in mpdir.glob("*.db"):
        p.unlink()
    for pid in _dead_pids(300):
        for typ, data in real.items():
            (mpdir / f"{typ}_{pid}.db").write_bytes(data)
    reads: list[str] = []
    real_read = mp.read_bytes
    monkeypatch.setattr(mp, "read_bytes",
                        lambda path, **kw: reads.append(path) or real_read(path, **kw))
    bad: list[str] = []
    collector = mp.TolerantMultiProcessCollector(str(mpdir), bad.append)
    first = list(collector.collect())
    files = sorted(str(p) for p in mpdir.glob("*.db"))
    assert _samples(first) == _samples(MultiProcessCollector.merge(files, accumulate=True))
    assert len(reads) == len(files) and not bad
    reads.clear()
    assert _samples(collector.collect()) == _samples(first)
    assert reads == []  # nothing changed: nothing read
    (mpdir / "counter_4194303.db").write_bytes(b"")  # one more dead process, empty
    assert _samples(collector.collect()) == _samples(first)
    assert reads == [str(mpdir / "counter_4194303.db")]
    assert bad == [str(mpdir / "counter_4194303.db")]


def test_the_merge_matches_the_librarys_for_every_gauge_mode(tmp_path: Path) -> None:
    script = """
import os, sys, time
from prometheus_client import Counter, Gauge, Histogram
modes = ["all", "liveall", "min", "livemin", "max", "livemax", "sum", "livesum",
         "mostrecent", "livemostrecent"]
k = int(sys.argv[1])
for mode in modes:
    g = Gauge(f"g_{mode}", "h", ["a"], multiprocess_mode=mode)
    g.labels("x").set(k * 1.5 - 2)
    if k != 2:
        g.labels("y").set(-k)
Counter("c", "h", ["a"]).labels(str(k % 2)).inc(k)
Histogram("h", "h", buckets=(0.5, 1, 4)).observe(k * 0.7)
print("ok", flush=True)
sys.stdin.readline()
"""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(k)], env=_env(tmp_path),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for k in (1, 2, 3)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ok"
        files = sorted(str(p) for p in tmp_path.glob("*.db"))
        ours = mp.TolerantMultiProcessCollector(str(tmp_path), lambda path: None).collect()
        assert _samples(ours) == _samples(MultiProcessCollector.merge(files, accumulate=True))
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


# -- case 14: the directory deleted under a running endpoint ---------------------------------

def _get(port: int) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_a_deleted_directory_fails_the_scrape_visibly(
        mpdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(mp.TolerantMultiProcessCollector(str(mpdir), lambda path: None))
    # Every scrape collects anew (no page cache), so each answer shows the directory now.
    server = serve(registry, port=0, limits=ServerLimits(page_max_age_s=0))
    try:
        status, body = _get(server.port)
        assert status == 200 and b'kvmetrics_preemptions_total{engine="5"' in body
        saved = mpdir.parent / "saved"
        mpdir.rename(saved)
        with caplog.at_level(logging.WARNING, logger="kvmetrics"):
            answers = [_get(server.port) for _ in range(3)]
        assert [s for s, _ in answers] == [503] * 3
        assert answers[0][1].decode().strip().endswith("cannot be read: No such file or directory")
        said = [r for r in caplog.records if "cannot be read" in r.getMessage()]
        assert len(said) == 1 and said[0].exc_info is None
        saved.rename(mpdir)
        status, body = _get(server.port)
        assert status == 200 and b'kvmetrics_preemptions_total{engine="5"' in body
    finally:
        server.stop()
