"""Soaks: short campaigns in CI, the exit code, parallel and sharded runs, merged reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmetrics.cli.main import main
from kvmetrics.lab import soak as soak_module
from kvmetrics.lab.soak import Shard, SoakReport, SoakReportError, merge_reports, soak
from tests.lab_support import run_cli

pytestmark = pytest.mark.vllm


def _without_wall(data: dict) -> dict:
    return {k: v for k, v in data.items() if k not in ("wall_seconds", "digest")}


def test_short_soak_is_clean() -> None:
    report = soak(60, verify="off", seed=1000)
    assert report.scenarios == 60
    assert report.as_dict()["failing_seeds"] == []
    assert report.errors == report.invariant_violations == report.guard_rejected_increments == 0
    assert not report.failed


def test_historical_soak_finds_violations() -> None:
    report = soak(60, verify="off", accounting="historical", seed=1000)
    assert report.guard_rejected_increments > 0
    assert report.errors == 0
    assert not report.failed  # guard rejections are what the historical accounting is for


def test_soak_command() -> None:
    result = run_cli("soak", "--scenarios", "5", "--verify", "off", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["scenarios"] == 5
    bad = run_cli("soak", "--engines", "reference,tpu")
    assert bad.returncode == 2 and "unknown engine 'tpu'" in bad.stderr


#: Soak seeds whose scenario reads stale KV through vLLM's own recovery path, and the
#: defect of docs/vllm-defects.md whose patch removes it (docs/vllm-research.md, "Soak").
KNOWN_STALE_SEEDS = {37: "chunked-recompute-sharer", 43: "recompute-keeps-failed-block"}


def test_verified_soak_finds_vllms_stale_reads_and_the_evicting_recovery_fixes_them() -> None:
    for seed in KNOWN_STALE_SEEDS:
        for engine in ("reference", "vllm"):
            faithful = soak(1, (engine,), verify="full", seed=seed)
            assert faithful.verification_failed_blocks > 0, (engine, seed)
            assert faithful.invariant_violations == faithful.guard_rejected_increments == 0
            fixed = soak(1, (engine,), verify="full", seed=seed, recovery="evict")
            assert fixed.as_dict()["failing_seeds"] == [], (engine, seed)
    # The lab explains them: read before the recompute they were waiting for.
    from kvmetrics.lab.runner import run_lab
    from kvmetrics.lab.soak import scenario_config

    explained = run_lab(scenario_config(43, "reference", "unified", "full")).summary
    assert [c["cause"] for c in explained["findings"]["causes"]] == ["read_before_recompute"]
    wider = soak(12, verify="full", seed=60, recovery="evict")
    assert wider.as_dict()["failing_seeds"] == []


# -- exit code: non-zero on a crash or a finding, in every accounting mode ------------------


@pytest.mark.parametrize("accounting", ["unified", "historical"])
def test_soak_exits_1_when_the_verifier_finds_stale_kv(accounting: str) -> None:
    result = run_cli("soak", "--scenarios", "1", "--seed", "43", "--accounting", accounting,
                     "--json")
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stdout)["verification_failed_blocks"] > 0


def test_historical_soak_expects_rejections_and_the_invariants_they_break() -> None:
    """The historical run of tests/test_lab_runs.py: negative increments and the broken
    rollback invariant they cause are what the mode is for, not a soak failure."""
    from kvmetrics.lab.soak import Campaign, ScenarioOutcome

    for accounting, failed in (("historical", False), ("unified", True)):
        report = SoakReport(Campaign(1, 0, ("reference",), accounting, "off", "vllm"))
        report.add(ScenarioOutcome(0, "reference", invariant_violations=3,
                                   guard_rejected_increments=3, verification_failed_blocks=0))
        assert report.failed is failed


def test_historical_soak_with_only_guard_rejections_exits_0() -> None:
    # Seed 1021: the historical accounting's negative increments, refused by the guard.
    result = run_cli("soak", "--scenarios", "1", "--seed", "1021", "--accounting",
                     "historical", "--verify", "off", "--json")
    data = json.loads(result.stdout)
    assert data["guard_rejected_increments"] > 0 and data["verification_failed_blocks"] == 0
    assert result.returncode == 0, result.stderr
    unified = run_cli("soak", "--scenarios", "1", "--seed", "1021", "--verify", "off")
    assert unified.returncode == 0, unified.stderr  # the unified accounting has none


@pytest.mark.parametrize("accounting", ["unified", "historical"])
def test_soak_exits_1_when_a_scenario_crashes(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str],
                                              accounting: str) -> None:
    def crash(cfg):
        raise RuntimeError("engine blew up")

    monkeypatch.setattr(soak_module, "run_lab", crash)
    code = main(["soak", "--scenarios", "2", "--verify", "off", "--accounting", accounting,
                 "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1
    assert data["errors"] == 2
    assert data["failures"][0]["error"] == "RuntimeError: engine blew up"


# -- scale: jobs and shards give the report of one process ---------------------------------


def test_jobs_2_prints_the_same_report_as_jobs_1() -> None:
    # Seeds 40..55 include 43, so the failures list is not empty.
    runs = [run_cli("soak", "--scenarios", "16", "--seed", "40", "--jobs", jobs, "--json")
            for jobs in ("1", "2")]
    one, two = (json.loads(r.stdout) for r in runs)
    assert [r.returncode for r in runs] == [1, 1]
    assert one["failing_seeds"] == ["reference:43"]
    assert _without_wall(one) == _without_wall(two)


def test_shards_partition_the_seed_range() -> None:
    from kvmetrics.lab.soak import Campaign

    campaign = Campaign(103, 7, ("reference",), "unified", "off", "vllm")
    slices = [Shard(i, 5).seeds(campaign) for i in range(5)]
    assert [s for r in slices for s in r] == list(range(7, 110))
    assert max(map(len, slices)) - min(map(len, slices)) <= 1


def test_merged_shards_equal_the_whole_campaign(tmp_path: Path) -> None:
    whole = soak(14, verify="full", seed=37)
    assert whole.failures  # seeds 37 and 43
    shards = [soak(14, verify="full", seed=37, shard=Shard(i, 3)) for i in range(3)]
    assert sum(len(s.failures) for s in shards) == len(whole.failures)
    merged = merge_reports([SoakReport.from_dict(s.as_dict()) for s in reversed(shards)])
    assert _without_wall(merged.as_dict()) == _without_wall(whole.as_dict())
    # The same through the command line, from files.
    files = []
    for i, s in enumerate(shards):
        path = tmp_path / f"shard-{i}.json"
        path.write_text(json.dumps(s.as_dict()))
        files.append(str(path))
    result = run_cli("soak-merge", "--json", *files)
    assert result.returncode == 1  # the stale reads of seeds 37 and 43 fail the campaign
    assert _without_wall(json.loads(result.stdout)) == _without_wall(whole.as_dict())


def test_merge_keeps_every_failure() -> None:
    """Not only the first 20: a merge must see all of them."""
    from kvmetrics.lab.soak import Campaign, ScenarioOutcome

    campaign = Campaign(50, 0, ("reference",), "unified", "off", "vllm")
    parts = []
    for i in range(2):
        r = SoakReport(campaign, Shard(i, 2))
        for seed in r.seed_range():
            r.add(ScenarioOutcome(seed, "reference", 0, 0, 1))
        parts.append(SoakReport.from_dict(json.loads(json.dumps(r.as_dict()))))
    merged = merge_reports(parts)
    assert [o.seed for o in merged.failures] == list(range(50))
    assert merged.verification_failed_blocks == 50


def test_merge_refuses_incomplete_or_mixed_reports() -> None:
    reports = [soak(4, verify="off", seed=0, shard=Shard(i, 2)) for i in range(2)]
    with pytest.raises(SoakReportError, match="missing 1/2"):
        merge_reports(reports[:1])
    with pytest.raises(SoakReportError, match="given twice 0/2"):
        merge_reports([reports[0], reports[0], reports[1]])
    other = soak(4, verify="off", seed=1, shard=Shard(1, 2))
    with pytest.raises(SoakReportError, match="different campaigns"):
        merge_reports([reports[0], other])
    with pytest.raises(SoakReportError, match="not a version-2 soak report"):
        SoakReport.from_dict({"scenarios": 3})


def _shard_with_failure(tmp_path: Path, index: int = 0) -> tuple[dict, Path]:
    """Shard ``index`` of 2 of a 4-scenario campaign, with one failing scenario, as
    `kvmetrics soak --shard I/2 --output` would have written it."""
    from kvmetrics.lab.soak import Campaign, ScenarioOutcome

    report = SoakReport(Campaign(4, 0, ("reference",), "unified", "off", "vllm"),
                        Shard(index, 2))
    for seed in report.seed_range():
        report.add(ScenarioOutcome(seed, "reference", 0, 0, 3 if seed == 1 else 0))
    report.wall_seconds = 1.5
    path = tmp_path / f"shard-{index}.json"
    path.write_text(json.dumps(report.as_dict()))
    return report.as_dict(), path


def test_a_consistently_edited_shard_is_refused(tmp_path: Path) -> None:
    """Failures removed and every count zeroed, the shard still adds up: only its digest
    (over the campaign and the results) tells it from what the soak wrote."""
    data, path = _shard_with_failure(tmp_path)
    _, other = _shard_with_failure(tmp_path, 1)
    assert run_cli("soak-merge", str(path), str(other)).returncode == 1  # as written
    edited = {**data, "verification_failed_blocks": 0, "failing_seeds": [], "failures": []}
    path.write_text(json.dumps(edited))
    result = run_cli("soak-merge", str(path), str(other))
    assert result.returncode == 2, result.stdout
    assert "digest does not match its content" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    path.write_text(json.dumps({k: v for k, v in edited.items() if k != "digest"}))
    assert "has no digest" in run_cli("soak-merge", str(path), str(other)).stderr


@pytest.mark.parametrize("wall", ['"nan"', "NaN", "1e308", "-1", "1e999", "true"])
def test_a_shard_wall_time_that_is_not_a_time_is_refused(tmp_path: Path, wall: str) -> None:
    data, path = _shard_with_failure(tmp_path)
    _, other = _shard_with_failure(tmp_path, 1)
    text = json.dumps({**data, "wall_seconds": 0.25}).replace("0.25", wall)
    path.write_text(text)
    result = run_cli("soak-merge", "--json", str(path), str(other))
    assert result.returncode == 2, result.stdout
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


def test_merged_output_is_always_standard_json(tmp_path: Path) -> None:
    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} in the output")

    _, a = _shard_with_failure(tmp_path)
    _, b = _shard_with_failure(tmp_path, 1)
    out = tmp_path / "merged.json"
    result = run_cli("soak-merge", "--json", str(a), str(b), "--output", str(out))
    assert result.returncode == 1, result.stderr
    for text in (result.stdout, out.read_text()):
        merged = json.loads(text, parse_constant=no_constants)
        assert merged["wall_seconds"] == 3.0 and merged["failing_seeds"] == ["reference:1"]
        assert SoakReport.from_dict(merged).verification_failed_blocks == 3  # re-readable


def test_no_control_byte_from_a_shard_reaches_the_terminal(tmp_path: Path) -> None:
    from kvmetrics.cli.soak import print_report
    from kvmetrics.lab.soak_report import digest

    data, path = _shard_with_failure(tmp_path)
    hostile = "\x1b]0;pwned\x07\x1b[2J"
    for engines in (["reference", hostile], [hostile]):
        body = {k: v for k, v in data.items() if k != "digest"}
        body["campaign"] = {**body["campaign"], "engines": engines}
        path.write_text(json.dumps({**body, "digest": digest(body)}))
        result = run_cli("soak-merge", str(path))
        assert result.returncode == 2 and "\x1b" not in result.stderr + result.stdout
        assert "printable" in result.stderr
    # And the text report escapes whatever it is given (a report built in memory).
    import contextlib
    import io

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        print_report({**data, "campaign": {**data["campaign"], "engines": [hostile]},
                      "failing_seeds": [f"{hostile}:1"]}, as_json=False)
    assert "\x1b" not in shown.getvalue() and "\x07" not in shown.getvalue()
    assert "\\x1b]0;pwned\\x07" in shown.getvalue()


# -- --explain writes its report where a person looks for it ------------------------------

#: A seed whose scenario reads stale KV in two seconds (docs/soak.md's example).
EXPLAINED = "3"


def _explain_in(folder: Path, *args: str, without_matplotlib: bool = False
                ) -> subprocess.CompletedProcess[str]:
    """``kvmetrics soak --explain`` run in ``folder``, optionally as if matplotlib (the
    ``report`` extra) were not installed."""
    argv = ["soak", "--explain", EXPLAINED, *args]
    code = ("import sys; sys.modules['matplotlib'] = None; "
            if without_matplotlib else "import sys; ") + \
        f"from kvmetrics.cli.main import main; sys.exit(main({argv!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_explain_writes_its_report_here_and_says_where(tmp_path: Path) -> None:
    result = _explain_in(tmp_path)
    assert result.returncode == 1, result.stderr  # the scenario read stale KV
    assert result.stderr.splitlines() == [
        f"kvmetrics: report of reference:{EXPLAINED} written to reference-{EXPLAINED}.html"]
    assert [p.name for p in tmp_path.iterdir()] == [f"reference-{EXPLAINED}.html"]
    page = (tmp_path / f"reference-{EXPLAINED}.html").read_text()
    assert '<div class="verdict fail" id="verdict"><b>FAIL</b>' in page
    assert "verdict: FAIL - " in result.stdout


def test_explain_where_its_report_cannot_go_stops_before_the_run(tmp_path: Path) -> None:
    (tmp_path / f"reference-{EXPLAINED}.html").mkdir()
    result = _explain_in(tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"kvmetrics: error: the report reference-{EXPLAINED}.html: reference-{EXPLAINED}.html "
        "is a directory, not a file (--report-dir DIR writes it elsewhere)"]


def test_explain_without_matplotlib_explains_and_says_there_is_no_report(
        tmp_path: Path) -> None:
    result = _explain_in(tmp_path, without_matplotlib=True)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        "kvmetrics: no HTML report will be written: the HTML report needs matplotlib: pip "
        "install 'kvmetrics[report]' (or rerun scripts/install.sh, which installs it)"]
    assert "verdict: FAIL - " in result.stdout and list(tmp_path.iterdir()) == []
    # A report directory asked for by name is refused before the run instead.
    named = _explain_in(tmp_path, "--report-dir", ".", without_matplotlib=True)
    assert named.returncode == 2 and named.stdout == ""
    assert named.stderr.splitlines() == [
        "kvmetrics: error: the HTML report needs matplotlib: pip install 'kvmetrics[report]' "
        "(or rerun scripts/install.sh, which installs it)"]
