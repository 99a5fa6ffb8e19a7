"""Prometheus rules: promtool accepts and unit-tests them, and they name only real series.

An alert on a misspelled series (a forgotten ``_total``) never fires and nothing
says so; these tests make that a failure. promtool (Prometheus 2.42) must be on
PATH: the rules are checked by the same parser the server uses.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards.kv_cache_recovery import RUNBOOK_URL
from dashboards.lint import problems
from dashboards.queries import TARGET_SERIES

ROOT = Path(__file__).resolve().parents[1]
PROM_DIR = ROOT / "deploy" / "prometheus"
RULES = PROM_DIR / "rules.yml"
UNIT_TESTS = sorted((PROM_DIR / "tests").glob("*.yml"))
RUNBOOK = ROOT / "docs" / "runbook.md"
SEVERITIES = {"critical", "warning", "info"}


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"]]


ALERTS = [rule for rule in _rules() if "alert" in rule]
RECORDS = [rule for rule in _rules() if "record" in rule]
RECORD_NAMES = frozenset(rule["record"] for rule in RECORDS)


def _promtool(*args: str, cwd: Path = PROM_DIR) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) must be on PATH"
    return subprocess.run(
        [promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def github_anchors(markdown: str) -> set[str]:
    """Anchors GitHub generates for the headings of a Markdown file."""
    anchors: set[str] = set()
    for line in markdown.splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if match:
            text = re.sub(r"[^\w\- ]", "", match.group(1).lower())
            anchors.add(text.replace(" ", "-"))
    return anchors


def test_promtool_check_rules() -> None:
    result = _promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass() -> None:
    assert UNIT_TESTS, "no promtool unit tests in deploy/prometheus/tests"
    result = _promtool("test", "rules", *(str(p.relative_to(PROM_DIR)) for p in UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_config(tmp_path: Path) -> None:
    # A copy proves the config needs nothing but the rule file beside it.
    shutil.copy(PROM_DIR / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copy(RULES, tmp_path / RULES.name)
    result = _promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r.get("alert") or r["record"])
def test_rule_names_only_catalogue_series(rule: dict[str, Any]) -> None:
    assert problems(rule["expr"], RECORD_NAMES | set(TARGET_SERIES)) == []


@pytest.mark.parametrize("rule", RECORDS, ids=lambda r: r["record"])
def test_recording_rule_naming(rule: dict[str, Any]) -> None:
    # level:metric:operations; the colons keep them apart from exported names.
    level, metric, operations = rule["record"].split(":")
    assert level == "kvmetrics" and metric and operations


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r["alert"])
def test_alert_labels_and_annotations(rule: dict[str, Any]) -> None:
    assert rule["alert"].startswith("KVMetrics")
    assert rule.get("labels", {}).get("severity") in SEVERITIES
    annotations = rule.get("annotations", {})
    for key in ("summary", "description", "runbook_url"):
        assert annotations.get(key), f"{rule['alert']}: missing annotation {key}"
    url, _, anchor = annotations["runbook_url"].partition("#")
    assert url == RUNBOOK_URL
    assert anchor in github_anchors(RUNBOOK.read_text(encoding="utf-8")), anchor


def test_counter_violation_alert_is_critical_and_immediate() -> None:
    (rule,) = [r for r in ALERTS if r["alert"] == "KVMetricsCounterViolation"]
    assert rule["labels"]["severity"] == "critical"
    assert rule["for"] == "0m"
    assert "increase(kvmetrics_counter_violations_total[5m]) > 0" in rule["expr"]


def _unit_tests() -> list[dict[str, Any]]:
    return [
        test
        for path in UNIT_TESTS
        for test in yaml.safe_load(path.read_text(encoding="utf-8"))["tests"]
    ]


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r["alert"])
def test_every_alert_has_firing_and_silent_unit_tests(rule: dict[str, Any]) -> None:
    cases = [
        case
        for test in _unit_tests()
        for case in test.get("alert_rule_test", [])
        if case["alertname"] == rule["alert"]
    ]
    firing = [case for case in cases if case.get("exp_alerts")]
    assert firing, f"{rule['alert']}: no unit test where it fires"
    assert any(not case.get("exp_alerts") for case in cases), f"{rule['alert']}: never silent"
    for case in firing:
        for alert in case["exp_alerts"]:
            assert alert["exp_labels"]["severity"] == rule["labels"]["severity"]
            assert set(alert["exp_annotations"]) == set(rule["annotations"])


@pytest.mark.parametrize("rule", RECORDS, ids=lambda r: r["record"])
def test_every_recording_rule_has_an_expr_test(rule: dict[str, Any]) -> None:
    tested = {
        case["expr"].strip()
        for test in _unit_tests()
        for case in test.get("promql_expr_test", [])
        if case.get("exp_samples")
    }
    assert rule["record"] in tested


def test_unit_tests_load_the_rule_file() -> None:
    for path in UNIT_TESTS:
        files = yaml.safe_load(path.read_text(encoding="utf-8"))["rule_files"]
        assert [(path.parent / f).resolve() for f in files] == [RULES.resolve()], path.name


def _runbook_queries() -> list[str]:
    text = RUNBOOK.read_text(encoding="utf-8")
    return re.findall(r"```promql\n(.*?)```", text, flags=re.DOTALL)


def test_runbook_has_one_section_per_alert() -> None:
    anchors = github_anchors(RUNBOOK.read_text(encoding="utf-8"))
    assert {rule["alert"].lower() for rule in ALERTS} <= anchors


@pytest.mark.parametrize("query", _runbook_queries())
def test_runbook_queries_name_only_catalogue_series(query: str) -> None:
    assert problems(query, RECORD_NAMES | set(TARGET_SERIES)) == []
