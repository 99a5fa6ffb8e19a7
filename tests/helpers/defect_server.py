"""What the real-server defect tests share (tests/test_serve_stale.py,
tests/test_serve_defects.py, tests/test_serve_fail_sharer.py): a connector config
that fails exactly the loads a schedule names, and a client that gives up while its
request runs."""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any

from benchmarks.vllm_server import VllmServer


def scripted_faults_config(storage: Path, policy: str, fault_loads: list[int],
                           inner: str = "ExampleConnector",
                           inner_module_path: str | None = None) -> dict[str, Any]:
    """``--kv-transfer-config``: FaultInjectingConnector around ExampleConnector (or a test
    variant of it from ``inner_module_path``), failing block #1 of exactly the loads
    numbered ``fault_loads`` (loads are numbered per server, in the order they happen)."""
    extra: dict[str, Any] = {"inner_connector": inner,
                             "inner_extra_config": {"shared_storage_path": str(storage)},
                             "fault_loads": fault_loads, "fault_block": 1}
    if inner_module_path is not None:
        extra["inner_module_path"] = inner_module_path
    return {"kv_connector": "FaultInjectingConnector",
            "kv_connector_module_path": "kvmetrics.faults.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": policy,
            "kv_connector_extra_config": extra}


def send_unanswered(server: VllmServer, prompt: list[int],
                    max_tokens: int) -> http.client.HTTPConnection:
    """Send a greedy completion and leave its answer unread, so that the test can
    :func:`disconnect` while the request runs."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True}), {"Content-Type": "application/json"})
    return conn


def disconnect(conn: http.client.HTTPConnection) -> None:
    """Close the connection at once, as a client that gives up (vLLM aborts the request)."""
    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
