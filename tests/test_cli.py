"""The command line people expect: help with choices and examples, -v everywhere,
the catalogue as JSON, a rich progress bar on a terminal and plain text off it."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import time

import pytest

from kvmetrics.cli.main import COMMANDS
from tests.lab_support import console_script, run_cli

NAMES = [c.name for c in COMMANDS]


def test_the_commands() -> None:
    assert NAMES == ["run", "report", "soak", "soak-merge", "workloads", "catalogue",
                     "vllm-check", "demo-model"]
    top = run_cli("--help")
    assert top.returncode == 0
    for name in NAMES:
        assert name in top.stdout


@pytest.mark.parametrize("name", NAMES)
def test_every_command_has_examples_and_verbose(name: str) -> None:
    result = run_cli(name, "--help")
    assert result.returncode == 0, result.stderr
    assert "-v, --verbose" in result.stdout
    assert "examples:" in result.stdout
    examples = result.stdout.split("examples:")[1]
    assert f"kvmetrics {name}" in examples or name in ("report", "soak-merge")


def test_fixed_value_sets_are_shown_in_help() -> None:
    text = run_cli("run", "--help").stdout
    for choices in ("{recompute,fail}", "{unified,historical}", "{vllm,evict}",
                    "{full,sampled,off}", "{auto,cpu,cuda}", "{sync,async,mixed}",
                    "{reference,vllm}", "{kvmetrics,mooncake}"):
        assert choices in text, choices
    assert "{unified,historical}" in run_cli("soak", "--help").stdout


def test_a_mistyped_option_gets_the_closest_option_of_its_sub_command() -> None:
    result = run_cli("soak", "--scenario", "3", "--jbs=2")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == (
        "kvmetrics: error: unrecognized arguments: --scenario 3 --jbs=2 "
        "(--scenario: did you mean --scenarios?; --jbs: did you mean --jobs?)")
    # run's own options, not soak's: --fault-rate exists only there.
    assert "did you mean --fault-rate?" in run_cli("run", "--fault-rat", "0.1").stderr
    assert "did you mean" not in run_cli("run", "--zzzzzz").stderr


def test_catalogue_json() -> None:
    result = run_cli("catalogue", "--json")
    assert result.returncode == 0 and result.stderr == ""
    entries = {e["name"]: e for e in json.loads(result.stdout)}
    # Hand-written from the metric's definition in docs/metrics.md.
    assert entries["kvmetrics_kv_load_blocks_total"] == {
        "name": "kvmetrics_kv_load_blocks_total", "type": "counter", "unit": "blocks",
        "labels": {"model_name": None, "engine": None, "mode": ["sync", "async"],
                   "outcome": ["ok", "failed"]},
        "help": entries["kvmetrics_kv_load_blocks_total"]["help"]}
    assert entries["kvmetrics_kv_cache_usage_ratio"]["type"] == "gauge"
    assert entries["kvmetrics_recovery_duration_seconds"]["unit"] == "seconds"
    assert all(e["help"] and set(e) == {"name", "type", "unit", "labels", "help"}
               for e in entries.values())
    plain = run_cli("catalogue").stdout.splitlines()
    assert [line.split()[0] for line in plain] == list(entries)


def _run_in_terminal(*args: str, timeout: float = 300) -> tuple[int, str]:
    """Run the console script with a pseudo-terminal as stdout and stderr."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([console_script(), *args], stdin=subprocess.DEVNULL,
                            stdout=follower, stderr=follower, env={**os.environ,
                                                                   "COLUMNS": "120"})
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(leader)
    return proc.wait(timeout=30), b"".join(chunks).decode("utf-8", "replace")


def test_a_terminal_gets_a_progress_bar_and_a_drawn_table() -> None:
    code, screen = _run_in_terminal("run", "--verify", "off", "--max-requests", "40",
                                    "--realtime", "--step-seconds", "0.005")
    assert code == 0, screen
    assert "\x1b[" in screen  # terminal styling
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)
    assert re.search(r"━+ +40/40 requests", text), text[-2000:]
    assert "local prefix hits" in text


def test_piped_output_is_plain() -> None:
    result = run_cli("run", "--verify", "off", "--max-requests", "20")
    assert result.returncode == 0
    assert "\x1b" not in result.stdout and result.stderr == ""
    assert result.stdout.splitlines()[0].split() == ["engine", "reference"]
