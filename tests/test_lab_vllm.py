"""The lab on vLLM's real scheduler: same command, --engine vllm."""

from __future__ import annotations

import json

import pytest

from tests.lab_support import run_cli

pytestmark = pytest.mark.vllm


def test_vllm_run_is_verified_and_clean() -> None:
    result = run_cli("run", "--engine", "vllm", "--max-requests", "120", "--fault-rate", "0.05",
                     "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["engine"] == "vllm"
    assert summary["requests"]["finished"] == 120
    assert summary["kv_load"]["blocks_failed"] > 0
    assert summary["verification"]["verified_tokens"] > 0
    assert summary["verification"]["failed_blocks"] == 0
    assert summary["guard_rejected_increments"] == summary["invariant_violations"] == 0


def test_vllm_has_no_historical_accounting() -> None:
    result = run_cli("run", "--engine", "vllm", "--accounting", "historical", "--verify", "off")
    assert result.returncode == 2
    assert "needs --engine reference" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_stalled_engine_ends_the_run_with_one_line(tmp_path) -> None:
    """vLLM 0.33's stall after an async load fails in every block (docs/vllm-defects.md,
    ``async-load-stall``) ends the lab run with exit 1 and one line, on vLLM and on the
    reference engine, which reproduces it under ``--recovery vllm``; with ``--recovery
    evict`` both finish the trace (on vLLM, its scheduler's protective mode)."""
    from kvmetrics.lab.vllm.differential import random_workload

    workload = random_workload(0, 40, load_mode="async", doc_blocks=(2, 4), suffix=(1, 20))
    trace = tmp_path / "stall.jsonl"
    trace.write_text("".join(
        json.dumps({"id": s.request_id, "arrival_s": i * 0.04,
                    "prompt_token_ids": list(s.tokens), "output_length": s.max_tokens}) + "\n"
        for i, s in enumerate(workload.requests)))
    args = ("run", "--trace", str(trace), "--block-size", "16", "--num-gpu-blocks", "12",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--fault-mode", "async",
            "--fault-rate", "0.5", "--verify", "off", "--json")
    for engine in ("vllm", "reference"):
        stalled = run_cli(*args, "--engine", engine)
        assert stalled.returncode == 1
        assert f"the {engine} engine stalled" in stalled.stderr
        assert "Traceback" not in stalled.stderr
    fixed = [run_cli(*args, "--engine", engine, "--recovery", "evict")
             for engine in ("vllm", "reference")]
    for result in fixed:
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["requests"]["finished"] == 40
    totals = [json.loads(r.stdout) for r in fixed]
    for summary in totals:  # all but the engine's name and the time it took
        summary.pop("engine")
        summary.pop("wall_seconds")
        summary["config"].pop("engine")
    assert totals[0] == totals[1]


def test_the_model_folder_is_removed_when_its_process_exits(tmp_path) -> None:
    """vLLM's config needs a model folder on disk; each process made one in the
    temporary directory and left it there (hundreds after a test run). A forked child
    that exits must not remove its parent's folder."""
    import os
    import subprocess
    import sys

    script = (
        "import os, sys\n"
        "from kvmetrics.lab.vllm.builder import model_dir\n"
        "path = model_dir(64)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(path, os.path.isfile(os.path.join(path, 'config.json')))\n"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120, check=True).stdout.split()
    assert out[1] == "True", "a forked child's exit removed the parent's model folder"
    assert out[0].startswith(str(tmp_path))
    assert not os.path.exists(out[0])
