"""``serve=process``: the engine only records, a supervised exporter process serves.

Each test runs an engine (``tests.helpers.serve_engine``: the vLLM integration's
exporter fed by the lab's reference engine) in a process of its own, because the mode
switches that process's prometheus-client to multiprocess files for good.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.tls import make_tls_material
from kvmetrics.vllm.exporting import check_setting_keys
from tests.helpers import procs

REPO = Path(__file__).resolve().parent.parent
SEED = "7"


class Engine:
    def __init__(self, mode: str, addr: str = "127.0.0.1:0", *tls_files: str,
                 tmpdir: Path | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        if tmpdir is not None:
            env["TMPDIR"] = str(tmpdir)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.serve_engine", mode, addr, SEED, *tls_files],
            cwd=REPO,
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read() if self.proc.stderr else ""
        self.info: dict[str, Any] = json.loads(line)

    @property
    def port(self) -> int:
        return self.info["port"]

    def more(self) -> list[list[Any]]:
        """Run another workload in the engine; its totals after it."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("more\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def shutdown(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("shutdown\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "done"
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    started: list[Engine] = []
    yield started
    for engine in started:
        child = engine.info.get("child")
        engine.stop()
        # It goes by itself (and removes its files) once the engine is gone; never left
        # running by a failed test.
        if child and not procs.wait_gone(child, 30):
            procs.kill(child)


def _page(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return r.read().decode()


def _samples(page: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The kvmetrics samples of a page; of a duration histogram (wall time, different in
    two runs of one workload) only the count."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(page)
            if family.name.startswith("kvmetrics_") for s in family.samples
            if "_seconds" not in s.name or s.name.endswith("_count")}


def test_the_exporter_process_serves_the_page_the_engine_would(engines: list[Engine]) -> None:
    in_engine = Engine("engine")
    engines.append(in_engine)
    in_process = Engine("process")
    engines.append(in_process)
    assert in_process.info["child"] and in_engine.info["child"] is None
    assert in_process.info["totals"] == in_engine.info["totals"]
    expected = _samples(_page(in_engine.port))
    assert any(v for v in expected.values())
    assert _samples(_page(in_process.port)) == expected
    # The engine process listens on nothing: the exporter process owns the port.
    assert procs.listening_ports(in_process.proc.pid) == []
    assert procs.listening_ports(in_process.info["child"]) == [in_process.port]
    in_process.shutdown()
    assert not procs.running(in_process.info["child"])
    assert not os.path.exists(in_process.info["dir"])


def test_the_exporter_process_serves_mutual_tls(engines: list[Engine], tmp_path: Path) -> None:
    tls = make_tls_material(tmp_path)
    engine = Engine("process", "127.0.0.1:0", str(tls.server_cert), str(tls.server_key),
                    str(tls.ca_cert))
    engines.append(engine)
    url = f"https://127.0.0.1:{engine.port}/metrics"
    with urllib.request.urlopen(url, context=tls.client_context(), timeout=30) as r:
        assert b'kvmetrics_rolled_back_tokens_total{engine="0"' in r.read()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, context=tls.client_context(with_cert=False),
                               timeout=30).read()
    with pytest.raises(OSError):
        _page(engine.port)  # plain HTTP


def _sums(totals: list[list[Any]]) -> dict[str, float]:
    """The engine's own totals, summed per counter family."""
    sums: dict[str, float] = {}
    for name, _values, value in totals:
        if name.endswith("_total"):
            sums[name] = sums.get(name, 0.0) + value
    return sums


def _counter_sums(page: str) -> dict[str, float]:
    """A page's kvmetrics counter samples, summed per family, zero sums left out (the
    engine's totals hold only series that counted)."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name.startswith("kvmetrics_") and s.name.endswith("_total") and \
                    family.type == "counter":
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    return {name: value for name, value in sums.items() if value}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_exporter_comes_back_with_the_same_totals(engines: list[Engine],
                                                           sig: signal.Signals) -> None:
    """SIGTERM too: the exporter alone is stopped, so the engine's files stay. The
    engine counts on meanwhile; the new exporter serves every count."""
    engine = Engine("process")
    engines.append(engine)
    assert _counter_sums(_page(engine.port)) == _sums(engine.info["totals"])
    first = engine.info["child"]
    os.kill(first, sig)
    totals = engine.more()  # the engine counts on while its exporter is gone
    deadline = time.monotonic() + 60
    page = None
    while page is None and time.monotonic() < deadline:
        time.sleep(0.2)
        if any(pid != first for pid in procs.children(engine.proc.pid)):
            try:
                page = _page(engine.port)
            except OSError:
                continue
    assert page is not None, "the exporter did not come back"
    assert _counter_sums(page) == _sums(totals) != _sums(engine.info["totals"])
    (child,) = procs.children(engine.proc.pid)
    engine.info["child"] = child
    assert engine.proc.stderr is not None
    engine.shutdown()
    stderr = engine.proc.stderr.read()
    assert "exited with " in stderr and "; starting it again" in stderr
    assert not procs.running(child)


def test_a_killed_engine_takes_its_exporter_and_files_with_it(engines: list[Engine]) -> None:
    engine = Engine("process")
    engines.append(engine)
    child = engine.info["child"]
    os.kill(engine.proc.pid, signal.SIGKILL)  # no hook of the engine runs
    engine.proc.wait(timeout=30)
    assert procs.wait_gone(child, 30)
    assert not os.path.exists(engine.info["dir"])


def test_an_engine_killed_with_its_exporter_leaves_files_the_next_start_removes(
        engines: list[Engine], tmp_path: Path) -> None:
    """``vllm serve``'s shutdown SIGKILLs the EngineCore and every process below it at
    once (its log: "force killing sub process"): neither can remove the directory."""
    first = Engine("process", tmpdir=tmp_path)
    engines.append(first)
    os.kill(first.info["child"], signal.SIGKILL)
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait(timeout=30)
    assert os.path.isdir(first.info["dir"])
    second = Engine("process", tmpdir=tmp_path)
    engines.append(second)
    assert not os.path.exists(first.info["dir"])
    assert os.path.isdir(second.info["dir"])
    assert "removed 1 metric file directory left in" in second.proc.stderr.readline()


def test_only_unmistakable_directories_of_dead_engines_are_removed(tmp_path: Path) -> None:
    """Run as root in a shared temporary folder: everything that is not exactly what an
    engine leaves (a link, a foreign file, another owner, a live engine, a FIFO, a pid of
    another pid namespace) stays."""
    from kvmetrics.exporters.private_dirs import pid_namespace, remove_left_behind

    gone = subprocess.Popen(["true"])
    gone.wait()
    ns = pid_namespace()
    dead, live = f"{gone.pid}-{ns}", f"{os.getpid()}-{ns}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (elsewhere / "counter_1.db").write_bytes(b"keep")

    def made(name: str, files: dict[str, bytes], mode: int = 0o700) -> Path:
        path = tmp_path / name
        path.mkdir()
        for file, data in files.items():
            (path / file).write_bytes(data)
        path.chmod(mode)
        return path

    value_files = {"counter_7.db": b"x", "gauge_livemostrecent_7.db": b"y"}
    stale = made(f"kvmetrics-{dead}-abcd_123", value_files)
    empty = made(f"kvmetrics-{dead}-abcd_124", {})
    kept = [
        made(f"kvmetrics-{live}-abcd_123", value_files),
        made(f"kvmetrics-{dead}-abcd_125", {**value_files, "notes.txt": b"mine"}),
        made(f"kvmetrics-{dead}-abcd_126", value_files, mode=0o755),
        made(f"kvmetrics-{dead}-abcd_12", value_files),  # not mkdtemp's name
        made(f"kvmetrics-{dead}-abcd_127", {}),
        tmp_path / f"kvmetrics-{dead}-abcd_128",
        tmp_path / f"kvmetrics-{dead}-abcd_129",
        made(f"kvmetrics-{dead}-abcd_130", value_files),
        made(f"kvmetrics-9999999999-{ns}-abcd_123", value_files),
        made(f"kvmetrics-{gone.pid}-{ns + 1}-abcd_123", value_files),  # another namespace
        made(f"kvmetrics-{gone.pid}-abcd_123", value_files),  # no namespace
    ]
    (kept[4] / "counter_8.db").symlink_to(elsewhere / "counter_1.db")
    kept[5].symlink_to(elsewhere, target_is_directory=True)
    os.mkfifo(kept[6])
    os.chown(kept[7], 65534, 65534)  # nobody's

    assert remove_left_behind(str(tmp_path)) == 2
    assert not stale.exists() and not empty.exists()
    assert all(os.path.lexists(path) for path in kept)
    assert (elsewhere / "counter_1.db").read_bytes() == b"keep"
    assert sorted(p.name for p in kept[1].iterdir()) == sorted([*value_files, "notes.txt"])


def test_a_connection_flood_reaches_no_thread_of_the_engine(engines: list[Engine]) -> None:
    engine = Engine("process")
    engines.append(engine)
    threads = procs.threads(engine.proc.pid)
    linger = struct.pack("ii", 1, 0)  # close with RST
    for _ in range(200):
        with socket.create_connection(("127.0.0.1", engine.port), timeout=10) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
    # The engine has no socket to accept them on and no thread came or went for them;
    # the exporter, after the flood, still serves the engine's values.
    assert procs.listening_ports(engine.proc.pid) == []
    assert procs.inet_sockets(engine.proc.pid) == []
    assert procs.threads(engine.proc.pid) == threads
    assert any(v for v in _samples(_page(engine.port)).values())


def test_a_port_in_use_gives_one_error_line_and_no_exporter(engines: list[Engine]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        engine = Engine("process", f"127.0.0.1:{port}")
        engines.append(engine)
        assert engine.info["child"] is None
        assert procs.children(engine.proc.pid) == []
        engine.shutdown()
    assert engine.proc.stderr is not None
    errors = [line for line in engine.proc.stderr.read().splitlines() if "ERROR" in line]
    assert len(errors) == 1 and f"cannot serve metrics on 127.0.0.1:{port}" in errors[0]
    assert "serving metrics on" not in "".join(errors)


class _Config:
    def __init__(self, ours: dict[str, Any]) -> None:
        self.additional_config = {"kvmetrics": ours}
        self.parallel_config = type("P", (), {"data_parallel_index": 0})()
        self.model_config = type("M", (), {"served_model_name": "m", "model": "m"})()


def test_a_bad_serve_mode_stops_the_start_with_one_line() -> None:
    check_setting_keys(_Config({"serve": "process"}))
    with pytest.raises(ValueError, match=r"^kvmetrics: serve \(KVMETRICS_SERVE\) must be one of "
                                         r"engine, process, got 'sidecar'$"):
        check_setting_keys(_Config({"serve": "sidecar"}))


def _default_mode_in_child(answers: Any) -> None:
    from kvmetrics.vllm.exporting import settings_for

    answers.put(settings_for(_Config({}), env={}).serve)


def test_an_engine_core_of_its_own_serves_from_a_process_and_an_in_process_one_itself() -> None:
    """``vllm serve`` starts the EngineCore with multiprocessing: the exporter process
    serves there. An engine inside the caller's process serves itself, since serving
    from another process would switch that whole process's prometheus-client."""
    import multiprocessing

    from kvmetrics.vllm.exporting import settings_for

    assert settings_for(_Config({}), env={}).serve == "engine"
    assert settings_for(_Config({}), env={"KVMETRICS_SERVE": "process"}).serve == "process"
    assert settings_for(_Config({"serve": "engine"}), env={}).serve == "engine"
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    child = context.Process(target=_default_mode_in_child, args=(answers,))
    child.start()
    try:
        assert answers.get(timeout=120) == "process"
    finally:
        child.join(60)
    assert child.exitcode == 0


_TWO_EXPORTERS = """
import os, sys, urllib.request
from kvmetrics.exporters import process
from kvmetrics.exporters.prometheus_internals import values_in_memory

def status(child):
    with urllib.request.urlopen(child.url + "metrics", timeout=30) as r:
        return r.status

first = process.start_serve_process(("127.0.0.1", 0), None)
second = process.start_serve_process(("127.0.0.1", 0), None)
shared = first.settings.directory
assert second.settings.directory == shared
assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == shared and not values_in_memory()
first.stop()
assert os.path.isdir(shared) and status(second) == 200
second.stop()
assert not os.path.exists(shared)
assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ and values_in_memory()
third = process.start_serve_process(("127.0.0.1", 0), None)
assert third.settings.directory != shared and status(third) == 200
third.stop()
assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ and values_in_memory()
print("ok")
"""


def test_exporters_of_one_process_share_its_directory_until_the_last_one_stops() -> None:
    """Engines built one after another in one process each start an exporter: one that
    stops leaves the directory to the others, and the last one puts the process back
    as it was (no stale ``PROMETHEUS_MULTIPROC_DIR`` for the next engine)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    done = subprocess.run([sys.executable, "-c", _TWO_EXPORTERS], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr


def test_the_exporter_counts_a_file_it_leaves_out_of_the_page(engines: list[Engine]) -> None:
    engine = Engine("process")
    engines.append(engine)
    (Path(engine.info["dir"]) / "counter_4242.db").write_bytes(b"\x00" * 3)  # no header

    def left_out() -> float:
        return sum(s.value for family in text_string_to_metric_families(_page(engine.port))
                   if family.name == "kvmetrics_scrape_errors" for s in family.samples
                   if s.labels == {"model_name": "default", "engine": "0",
                                   "reason": "unreadable_multiprocess_file"})

    assert _counter_sums(_page(engine.port))  # the page is served without the file
    deadline = time.monotonic() + 30
    while left_out() < 1:  # counted in the exporter's own file, written within 0.1 s
        assert time.monotonic() < deadline, "the left-out file was never counted"
        time.sleep(0.2)
