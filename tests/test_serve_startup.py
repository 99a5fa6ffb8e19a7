"""A bad FaultInjectingConnector setting, or an unknown key in
``--additional-config '{"kvmetrics": ...}'``, stops ``vllm serve`` at start-up with one
line naming the key (vLLM's own traceback around it is vLLM's; the message is ours).

Measured on the 2-core CI kind of machine: each server gives up after 30-50 s (the
worker builds its connector, the engine core its scheduler, before serving).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.serve_requests import connector_config
from benchmarks.vllm_server import ServerSpec, VllmServer

pytestmark = pytest.mark.serve


def test_a_bad_fault_rate_stops_the_server_naming_the_key(tmp_path: Path) -> None:
    config = connector_config(tmp_path / "kv", "recompute", fault_rate=1.5)
    server = VllmServer(ServerSpec(kv_transfer=config), tmp_path)
    code = server.run_to_exit()
    assert code != 0
    expected = ("FaultInjectingConnector: kv_connector_extra_config.fault_rate: "
                "must be a number from 0 to 1, got 1.5")
    lines = [line for line in server.log().splitlines() if expected in line]
    assert lines, server.log_tail()
    # Never a hang: nothing of the server is left running.
    assert server.process is not None and server.process.poll() is not None


def test_a_misspelt_kvmetrics_setting_stops_the_server_naming_it(tmp_path: Path) -> None:
    """A typo in ``--additional-config`` must not leave a replica silently unprotected."""
    extra = ["--additional-config", '{"kvmetrics": {"recovry": "evict"}}']
    server = VllmServer(ServerSpec(extra_args=extra), tmp_path)
    code = server.run_to_exit()
    assert code != 0
    expected = "additional_config.kvmetrics: unknown setting 'recovry' (known: "
    assert any(expected in line for line in server.log().splitlines()), server.log_tail()
    assert server.process is not None and server.process.poll() is not None
