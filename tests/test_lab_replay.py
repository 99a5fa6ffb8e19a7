"""Every soak scenario is a command: the printed `kvmetrics run` line replays it exactly."""

from __future__ import annotations

import re
import shlex
from dataclasses import fields, replace
from pathlib import Path

import pytest

from kvmetrics.cli.main import build_parser
from kvmetrics.cli.run import config_from_args
from kvmetrics.lab.config import LabConfig
from kvmetrics.lab.replay import NOT_REPLAYED, RUN_OPTIONS, run_arguments, run_command
from kvmetrics.lab.soak import scenario_config
from tests.lab_support import run_cli

pytestmark = pytest.mark.vllm


def _parsed(args: list[str]) -> LabConfig:
    cfg = config_from_args(build_parser().parse_args(["run", *args]))
    return replace(cfg, progress=False)


def test_every_setting_is_an_option_or_deliberately_not() -> None:
    replayed = {o.field for o in RUN_OPTIONS}
    assert not replayed & NOT_REPLAYED
    assert replayed | NOT_REPLAYED == {f.name for f in fields(LabConfig)}


def test_cli_defaults_are_the_configs_defaults() -> None:
    """run_arguments leaves out default settings, so the two must agree."""
    assert _parsed([]) == LabConfig(progress=False)


def test_scenarios_round_trip_through_the_command_line() -> None:
    for seed in range(60):
        for engine, verify, recovery in (("reference", "full", "vllm"),
                                         ("vllm", "sampled", "evict")):
            cfg = scenario_config(seed, engine, "unified", verify, recovery)
            assert _parsed(run_arguments(cfg)) == cfg, run_command(cfg)
    changed = replace(LabConfig(), verify="sampled", verify_fraction=0.5, trace="a b.jsonl")
    assert _parsed(shlex.split(run_command(changed))[2:]) == replace(changed, progress=False)


def _failed_blocks(text: str) -> int:
    match = re.search(r"\((\d+) stale block reads\)", text)
    assert match, text
    return int(match.group(1))


def test_printed_replay_line_reproduces_the_stale_reads(tmp_path: Path) -> None:
    soak = run_cli("soak", "--scenarios", "1", "--seed", "43")
    assert soak.returncode == 1, soak.stderr
    found = int(re.search(r"verification_failed_blocks\s+(\d+)", soak.stdout).group(1))
    assert found > 0
    lines = [line.strip() for line in soak.stdout.splitlines()
             if line.strip().startswith("kvmetrics run ")]
    assert len(lines) == 1, soak.stdout
    page = tmp_path / "r.html"
    replay = run_cli(*shlex.split(lines[0])[1:], "--report", str(page))
    assert replay.returncode == 3, replay.stderr  # stale reads: exit 3 unless allowed
    assert "Traceback" not in replay.stderr
    assert _failed_blocks(replay.stdout) == found
    assert "chunked-recompute-sharer" in page.read_text()
    explained = run_cli("soak", "--explain", "43", "--report-dir", str(tmp_path))
    assert explained.returncode == 1, explained.stderr
    assert _failed_blocks(explained.stdout) == found
    assert lines[0] in explained.stdout
    report = (tmp_path / "reference-43.html").read_text()
    assert "chunked-recompute-sharer" in report and "--recovery evict" in report


def test_report_groups_the_configuration_as_the_cli_does() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a.choices, dict))
    run = sub.choices["run"]
    group_of = {action.dest: group.title for group in run._action_groups
                for action in group._group_actions}
    for option in RUN_OPTIONS:
        assert group_of[option.field] == option.group, option
