"""Prometheus rules: promtool accepts and unit-tests them, and they name only real series.

An alert on a misspelled series (a forgotten ``_total``) never fires and nothing
says so; these tests make that a failure. promtool (Prometheus 2.42) must be on
PATH: the rules are checked by the same parser the server uses.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards.kv_cache_recovery import ROWS, RUNBOOK_URL
from dashboards.lint import problems
from dashboards.queries import TARGET_SERIES
from kvmetrics.metrics import catalogue as cat
from tests.test_deploy import _generate_module

pytestmark = pytest.mark.prometheus

_GENERATE = _generate_module()
RUNBOOK_PATH = _GENERATE.RUNBOOK_PATH
generate = _GENERATE.main

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
    # As shipped, a path in this repository that exists, to a heading that exists.
    url, _, anchor = annotations["runbook_url"].partition("#")
    assert url == RUNBOOK_PATH and (ROOT / url).is_file(), url
    assert anchor == rule["alert"].lower()
    assert anchor in github_anchors(RUNBOOK.read_text(encoding="utf-8")), anchor


def test_the_dashboards_runbook_link_is_the_rules() -> None:
    assert RUNBOOK_URL == RUNBOOK_PATH and (ROOT / RUNBOOK_URL).is_file()


_LAB_ONLY = {s.name for s in cat.LAB_ONLY_FAMILIES}


@pytest.mark.parametrize("rule", ALERTS, ids=lambda r: r["alert"])
def test_lab_only_alerts_say_so(rule: dict[str, Any]) -> None:
    """An alert on a series only the lab exports never fires on a `vllm serve` replica:
    its `scope: lab` label says so (and routes it); no other alert carries a scope."""
    names = set(re.findall(r"kvmetrics_\w+", rule["expr"]))
    lab_only = bool(names & _LAB_ONLY)
    assert lab_only or not names & _LAB_ONLY
    assert rule["labels"].get("scope") == ("lab" if lab_only else None), rule["alert"]


def test_blind_spots_have_alerts() -> None:
    """What makes the other alerts blind has an alert of its own: a hook out of action,
    an unverified vLLM, a family the engine should compute that is not on its page."""
    exprs = {r["alert"]: " ".join(r["expr"].split()) for r in ALERTS}
    assert exprs["KVMetricsInstrumentationErrors"] == \
        f"{cat.INSTRUMENTATION_ERRORS.name} > 0"
    assert exprs["KVMetricsVLLMUnverified"] == \
        f'{cat.BUILD_INFO.name}{{vllm_verified="false"}} == 1'
    assert exprs["KVMetricsFamilyAbsent"] == f"{cat.FAMILY_LIVE.name} == 0"


def _alert(name: str) -> dict[str, Any]:
    (rule,) = [r for r in ALERTS if r["alert"] == name]
    return rule


def test_guard_and_invariant_alerts_are_immediate_warnings() -> None:
    guard, invariant = _alert("KVMetricsCounterViolation"), _alert("KVMetricsInvariantViolation")
    assert guard["expr"].strip() == "increase(kvmetrics_guard_rejected_increments_total[5m]) > 0"
    assert invariant["expr"].strip() == "increase(kvmetrics_invariant_violations_total[5m]) > 0"
    for rule in (guard, invariant):
        assert (rule["labels"]["severity"], rule["for"]) == ("warning", "0m")
    # An invariant is not a refused increment, and it may concern a gauge.
    assert "refused" not in invariant["annotations"]["summary"]
    assert "$labels.invariant" in invariant["annotations"]["summary"]


def test_only_what_users_see_pages() -> None:
    critical = {r["alert"] for r in ALERTS if r["labels"]["severity"] == "critical"}
    assert critical == {"KVMetricsKVVerificationFailures", "KVMetricsRequestsFailedByKVLoadPolicy"}


def _nodes(expr: str) -> list[object]:
    import promql_parser as pp

    found: list[object] = []
    pp.walk(pp.parse(expr), found.append, lambda node: None)
    return found


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r.get("alert") or r["record"])
def test_no_rule_merges_replicas(rule: dict[str, Any]) -> None:
    """A fleet's replicas all have engine="0": only job/instance (and namespace/pod) tell
    them apart, so no rule may aggregate `by` or match `on` a list that leaves them out.
    `without`/`ignoring` name what is merged and keep every other label."""
    import promql_parser as pp

    for node in _nodes(rule["expr"]):
        if isinstance(node, pp.AggregateExpr) and node.modifier is not None:
            assert str(node.modifier.type).endswith("Without"), f"by ({node.modifier.labels})"
            assert not {"job", "instance", "namespace", "pod"} & set(node.modifier.labels)
        if isinstance(node, pp.AggregateExpr) and node.modifier is None:
            assert str(node.op) not in ("sum", "avg", "max", "min", "count"), \
                "aggregation over every label"
        if isinstance(node, pp.BinaryExpr) and node.modifier is not None \
                and node.modifier.matching is not None:
            assert str(node.modifier.matching.type).endswith("Exclude"), \
                f"on ({node.modifier.matching.labels})"
            assert not {"job", "instance"} & set(node.modifier.matching.labels)


def _job_names() -> dict[str, set[str]]:
    """Job names of kvmetrics endpoints, as each deploy file and doc spells them."""
    prom = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text(encoding="utf-8"))
    monitor = yaml.safe_load(
        (ROOT / "deploy" / "kubernetes" / "podmonitor.yaml").read_text(encoding="utf-8"))
    docs: set[str] = set()
    for path in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        docs |= set(re.findall(r"job_name:\s*([\w.-]+)", path.read_text(encoding="utf-8")))
    return {
        "prometheus.yml": {c["job_name"] for c in prom["scrape_configs"]},
        "podmonitor.yaml": {relabel["replacement"]
                            for endpoint in monitor["spec"]["podMetricsEndpoints"]
                            for relabel in endpoint.get("relabelings", [])
                            if relabel.get("targetLabel") == "job"},
        "docs": docs,
    }


def test_exporter_down_watches_the_jobs_the_deploy_files_and_docs_use() -> None:
    expr = _alert("KVMetricsExporterDown")["expr"]
    (pattern,) = re.findall(r'job=~"([^"]+)"', expr)
    # The jobs that scrape kvmetrics' own endpoints, wherever they are written down;
    # `vllm` (vLLM's API server) and the Collector are other endpoints.
    others = {"vllm", "otel-collector"}
    names = _job_names()
    for where, jobs in names.items():
        kvmetrics_jobs = jobs - others
        assert kvmetrics_jobs, f"{where}: no kvmetrics job found"
        unmatched = {j for j in kvmetrics_jobs if not re.fullmatch(pattern, j)}
        assert not unmatched, f"{where}: KVMetricsExporterDown ({pattern}) misses {unmatched}"
        assert not {j for j in others & jobs if re.fullmatch(pattern, j)}
    assert names["podmonitor.yaml"] - others <= names["prometheus.yml"]


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
        case["expr"].strip().partition("{")[0]
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


def _alert_table(path: Path) -> dict[str, list[str]]:
    """The rows of a doc's alert table: alert name -> its other cells."""
    rows: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"\[?(KVMetrics\w+)(?:\]\(#\w+\))?", cells[0]) if cells else None
        if line.startswith("|") and match:
            assert match.group(1) not in rows, f"{path.name}: {match.group(1)} twice"
            rows[match.group(1)] = cells[1:]
    return rows


@pytest.mark.parametrize("doc", ["runbook.md", "dashboards.md"])
def test_docs_list_every_alert_as_rules_yml_has_it(doc: str) -> None:
    """The alert tables of the runbook and docs/dashboards.md name every alert of
    rules.yml, no other, with its severity, and `scope: lab` for the lab's alerts only."""
    table = _alert_table(ROOT / "docs" / doc)
    assert set(table) == {r["alert"] for r in ALERTS}
    for rule in ALERTS:
        severity = table[rule["alert"]][0]
        assert severity.split(",")[0] == rule["labels"]["severity"], (rule["alert"], severity)
        assert ("`scope: lab`" in severity) == (rule["labels"].get("scope") == "lab"), severity
        if doc == "runbook.md":
            assert table[rule["alert"]][1] == rule["for"], rule["alert"]


def test_runbook_names_the_dashboards_rows() -> None:
    """The runbook's list of dashboard rows is the dashboard's, in its order."""
    listed = re.search(r"its\s+rows\s+are\s+(.*?)\.$", RUNBOOK.read_text(encoding="utf-8"),
                       flags=re.MULTILINE | re.DOTALL)
    assert listed, "the runbook no longer lists the dashboard's rows"
    assert re.findall(r'"([^"]+)"', listed.group(1)) == [title for title, _ in ROWS]


def test_dashboards_doc_describes_every_row() -> None:
    """docs/dashboards.md's layout paragraph names each of the dashboard's rows."""
    text = (ROOT / "docs" / "dashboards.md").read_text(encoding="utf-8")
    layout = " ".join(text.split("**Layout.**")[1].split("**Query rules.**")[0].split()).lower()
    missing = [title for title, _ in ROWS if title.lower() not in layout]
    assert not missing, missing


def test_runbook_log_grep_finds_vllms_load_failure_lines() -> None:
    """The runbook's grep for a replica's failed loads names lines the installed vLLM's
    scheduler logs (under policy recompute and fail): a grep that finds nothing at 3 a.m.
    reads as "no failure"."""
    import importlib.util

    section = RUNBOOK.read_text(encoding="utf-8").split(
        "\n## KVMetricsKVLoadFailureRatioHigh\n")[1].split("\n## ")[0]
    pattern = re.search(r"`grep -E '([^']+)'`", section.replace("\n", " "))
    assert pattern, "the KV-load-failure section no longer says what to grep"
    spec = importlib.util.find_spec("vllm")
    assert spec and spec.submodule_search_locations, "vLLM is not installed in this venv"
    scheduler = Path(spec.submodule_search_locations[0], "v1", "core", "sched", "scheduler.py")
    source = scheduler.read_text(encoding="utf-8")
    alternatives = pattern[1].split("|")
    assert len(alternatives) == 2 and all(a in source for a in alternatives), alternatives


@pytest.mark.parametrize("query", _runbook_queries())
def test_runbook_queries_name_only_catalogue_series(query: str) -> None:
    assert problems(query, RECORD_NAMES | set(TARGET_SERIES)) == []


def test_runbook_base_is_the_operators(tmp_path: Path) -> None:
    """Every runbook link (each alert's, the dashboard's) is made absolute under the base
    the operator gives, and what comes out is still valid rules (promtool)."""
    base = "https://git.example.com/sre/kvmetrics/-/blob/main"
    assert generate(["--runbook-base", base + "/", "--out-dir", str(tmp_path)]) == 0
    rules = (tmp_path / "rules.yml").read_text()
    manifest = yaml.safe_load((tmp_path / "prometheusrule.yaml").read_text())
    for groups in (yaml.safe_load(rules)["groups"], manifest["spec"]["groups"]):
        urls = [r["annotations"]["runbook_url"] for g in groups for r in g["rules"]
                if "alert" in r]
        assert urls == [f"{base}/{RUNBOOK_PATH}#{r['alert'].lower()}" for r in ALERTS]
    configmap = yaml.safe_load((tmp_path / "dashboard-configmap.yaml").read_text())
    links = [link["url"] for text in configmap["data"].values()
             for link in json.loads(text)["links"]]
    assert links == [f"{base}/{RUNBOOK_PATH}"]
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: bash scripts/install.sh --test installs it"
    check = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    with pytest.raises(SystemExit):
        generate(["--runbook-base", 'https://x" evil', "--out-dir", str(tmp_path)])
