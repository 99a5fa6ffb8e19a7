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
from kvmetrics.integrations.vllm.exporting import check_setting_keys
from tests.helpers import procs

REPO = Path(__file__).resolve().parent.parent
SEED = "7"


class Engine:
    def __init__(self, mode: str, addr: str = "127.0.0.1:0", *tls_files: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
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


def test_the_engine_serves_by_default_and_the_exporter_process_is_the_opt_in() -> None:
    from kvmetrics.integrations.vllm.exporting import settings_for

    assert settings_for(_Config({}), env={}).serve == "engine"
    assert settings_for(_Config({}), env={"KVMETRICS_SERVE": "process"}).serve == "process"
    assert settings_for(_Config({"serve": "process"}), env={}).serve == "process"
