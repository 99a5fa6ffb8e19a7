"""Bad input through the real console script: one line naming the problem, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.lab_support import run_cli

GOOD_LINE = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}


def _trace(tmp_path: Path, lines: list[str]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _assert_clean_error(result, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_trace(tmp_path: Path) -> None:
    _assert_clean_error(run_cli("run", "--trace", str(tmp_path / "nope.jsonl")),
                        "cannot read trace", "nope.jsonl")


def test_bad_json_names_the_line(tmp_path: Path) -> None:
    path = _trace(tmp_path, [json.dumps(GOOD_LINE), "{not json"])
    _assert_clean_error(run_cli("run", "--trace", path, "--trace-format", "mooncake"),
                        "trace.jsonl:2", "bad JSON")


@pytest.mark.parametrize(("record", "needle"), [
    ({"timestamp": 0, "output_length": 4, "hash_ids": [1]}, "missing field 'input_length'"),
    ({**GOOD_LINE, "input_length": -5}, "'input_length' must be >= 1"),
    ({**GOOD_LINE, "output_length": -1}, "'output_length' must be >= 1"),
    ({**GOOD_LINE, "hash_ids": [1, 2, 3]}, "3 hash_ids do not match a length of 600"),
    ({**GOOD_LINE, "hash_ids": "abc"}, "'hash_ids' must be a list"),
])
def test_malformed_mooncake_records(tmp_path: Path, record: dict, needle: str) -> None:
    path = _trace(tmp_path, [json.dumps(GOOD_LINE), json.dumps(record)])
    _assert_clean_error(run_cli("run", "--trace", path, "--trace-format", "mooncake"),
                        "trace.jsonl:2", needle)


def test_malformed_kvmetrics_record(tmp_path: Path) -> None:
    path = _trace(tmp_path, [json.dumps({"arrival_s": 0, "output_length": 3})])
    _assert_clean_error(run_cli("run", "--trace", path), "trace.jsonl:1",
                        "prompt_token_ids")


@pytest.mark.parametrize(("args", "needle"), [
    (["--block-size", "0"], "--block-size must be a positive integer"),
    (["--fault-rate", "1.5"], "fault rate must be within 0..1"),
    (["--fault-rate", "-0.1"], "fault rate must be within 0..1"),
    (["--num-gpu-blocks", "4"], "blocks of 16 tokens but the cache holds 3"),
    (["--engine", "tpu"], "argument --engine: invalid choice: 'tpu'"),
    (["--policy", "retry"], "argument --policy: invalid choice: 'retry'"),
    (["--workload", "poetry"], "argument --workload: invalid choice: 'poetry'"),
    (["--verify", "some"], "argument --verify: invalid choice: 'some'"),
    (["--linger", "5"], "--linger needs --serve"),
    (["--verify-fraction", "0.5"], "--verify-fraction needs --verify sampled"),
    (["--report", "/nonexistent-dir/r.html"], "output directory /nonexistent-dir does not"),
    (["--serve", "localhost"], "expected HOST:PORT"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--max-requests", "many"], "invalid int value"),
])
def test_bad_configuration(args: list[str], needle: str) -> None:
    _assert_clean_error(run_cli("run", "--verify", "off", "--max-requests", "5", *args), needle)


def test_bad_fault_plan(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"rate": 0.1, "failures": [{"request": "x"}]}))
    _assert_clean_error(run_cli("run", "--verify", "off", "--fault-plan", str(plan)),
                        "failure #0 needs a 'block' index")


def test_failed_run_keeps_earlier_output(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    out.write_text('{"earlier": true}\n')
    result = run_cli("run", "--verify", "off", "--block-size", "0", "--output", str(out))
    assert result.returncode == 2
    assert out.read_text() == '{"earlier": true}\n'
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".summary")]


def test_device_choice() -> None:
    _assert_clean_error(run_cli("run", "--device", "tpu", "--max-requests", "3"),
                        "argument --device: invalid choice: 'tpu'")
    result = run_cli("run", "--device", "cuda", "--max-requests", "3", "--json")
    if torch.cuda.is_available():
        assert result.returncode == 0, result.stderr
    else:
        _assert_clean_error(result, "no CUDA device is available")


@pytest.mark.parametrize(("args", "needle"), [
    (["soak", "--engines", "reference,tpu"], "unknown engine 'tpu'"),
    (["soak", "--accounting", "new"], "argument --accounting: invalid choice: 'new'"),
    (["soak", "--shard", "4/4"], "shard must be I/N with 0 <= I < N"),
    (["soak", "--shard", "x"], "shard must be I/N"),
    (["soak", "--jobs", "0"], "--jobs must be a positive integer or auto"),
    (["soak", "--scenarios", "2", "--shard", "0/3"], "shard 0/3 of 2 scenarios is empty"),
    (["report", "/nonexistent.json"], "cannot read /nonexistent.json"),
    (["soak-merge", "/nonexistent.json"], "cannot read /nonexistent.json"),
    (["catalogue", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_other_commands_refuse_bad_input(args: list[str], needle: str) -> None:
    _assert_clean_error(run_cli(*args), needle)


def test_verify_fraction_with_sampled_is_accepted() -> None:
    result = run_cli("run", "--verify", "sampled", "--verify-fraction", "0.5",
                     "--max-requests", "5", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["config"]["verify_fraction"] == 0.5


def test_engine_without_vllm_installed_is_one_line() -> None:
    """vLLM made unimportable in the process: --engine vllm is still listed (its entry
    point exists) but refused with one line that says what to install."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['vllm'] = None; from kvmetrics.cli.main import main; "
            "sys.exit(main(['run', '--engine', 'vllm', '--verify', 'off', "
            "'--max-requests', '3']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    _assert_clean_error(result, "--engine vllm is not available", "vLLM is not installed",
                        "light CPU-only install")
