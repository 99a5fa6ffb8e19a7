"""The lab on vLLM's real scheduler: same command, --engine vllm."""

from __future__ import annotations

import json

from tests.lab_support import run_cli


def test_vllm_run_is_verified_and_clean() -> None:
    result = run_cli("run", "--engine", "vllm", "--max-requests", "120", "--fault-rate", "0.05",
                     "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["engine"] == "vllm"
    assert summary["requests"]["finished"] == 120
    assert summary["kv_load"]["blocks_failed"] > 0
    assert summary["verification"]["verified_tokens"] > 0
    assert summary["verification"]["failures"] == 0
    assert summary["counter_violations"] == 0


def test_vllm_has_no_historical_accounting() -> None:
    result = run_cli("run", "--engine", "vllm", "--accounting", "historical", "--verify", "off")
    assert result.returncode == 2
    assert "needs --engine reference" in result.stderr
    assert "Traceback" not in result.stderr
