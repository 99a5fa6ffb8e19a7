"""Dashboards: generated JSON is committed and current, and every query is sound.

No Grafana server runs here, so the checks are static: each target expression,
after Grafana's variables are substituted, must parse as PromQL, name only series
from the catalogue and carry the dashboard's model/engine filter. Running the
queries against a live Prometheus is the job of the end-to-end test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import promql_parser
import pytest

from dashboards import build, kv_cache_recovery
from dashboards.lint import problems, selectors
from dashboards.queries import (
    TARGET_SERIES,
    VLLM_FILTER,
    sel,
    substitute_grafana_vars,
    vllm_sum_rate,
)
from kvmetrics.metrics import catalogue

ROOT = Path(__file__).resolve().parents[1]
JSON_FILE = ROOT / "dashboards" / "kv-cache-recovery.json"
BOARD = build.dashboard_dict()
PANELS = [panel for panel in BOARD["panels"] if panel["type"] != "row"]
QUERIES = build.all_queries()


def test_build_is_deterministic_and_committed() -> None:
    assert build.render() == build.render()
    assert JSON_FILE.read_text(encoding="utf-8") == build.render(), (
        "dashboards/kv-cache-recovery.json is stale: run `python -m dashboards.build`"
    )


def test_check_flag_reports_current_json() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dashboards.build", "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr


def test_identity() -> None:
    assert BOARD["uid"] == "kvmetrics-kv-recovery"
    assert BOARD["title"] == "KV cache recovery"


def test_variables() -> None:
    variables = {v["name"]: v for v in BOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model_name", "instance", "engine"):
        var = variables[name]
        assert var["type"] == "query"
        assert var["multi"] and var["includeAll"]
        assert var["query"].startswith("label_values(")
        assert var["query"].endswith(f", {name})")
        assert var["datasource"]["uid"] == "${datasource}"


@pytest.mark.parametrize(("name", "expr"), build.variable_queries())
def test_variable_queries_name_catalogue_series(name: str, expr: str) -> None:
    assert problems(substitute_grafana_vars(expr)) == []


def test_rows() -> None:
    rows = [panel["title"] for panel in BOARD["panels"] if panel["type"] == "row"]
    assert rows == [title for title, _ in kv_cache_recovery.ROWS]


def test_top_row_is_seven_stats() -> None:
    top = [panel for panel in PANELS if panel["gridPos"]["y"] == 0]
    assert [panel["type"] for panel in top] == ["stat"] * 7
    assert sum(panel["gridPos"]["w"] for panel in top) == 24


@pytest.mark.parametrize("panel", PANELS, ids=lambda p: p["title"])
def test_panel_conventions(panel: dict[str, Any]) -> None:
    assert "id" not in panel, "panels get no id: Grafana assigns them"
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults.get("unit"), "every panel needs a unit"
    assert defaults["thresholds"]["steps"], "every panel needs thresholds"
    assert panel["description"]
    assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    ref_ids = [target["refId"] for target in panel["targets"]]
    assert ref_ids and len(set(ref_ids)) == len(ref_ids) and all(ref_ids)
    for target in panel["targets"]:
        assert target["datasource"] == panel["datasource"]


def test_panels_do_not_overlap() -> None:
    cells: set[tuple[int, int]] = set()
    for panel in BOARD["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & area, panel["title"]
        cells |= area


@pytest.mark.parametrize(("title", "expr"), QUERIES, ids=[t for t, _ in QUERIES])
def test_query_parses_and_names_catalogue_series(title: str, expr: str) -> None:
    plain = substitute_grafana_vars(expr)
    promql_parser.parse(plain)
    assert problems(plain, TARGET_SERIES) == []


@pytest.mark.parametrize(("title", "expr"), QUERIES, ids=[t for t, _ in QUERIES])
def test_query_is_filtered(title: str, expr: str) -> None:
    vllm_names = {spec.name for spec in catalogue.VLLM_SERIES}
    for selector in selectors(substitute_grafana_vars(expr)):
        matchers = {(label, op) for label, op, _ in selector.matchers}
        if selector.name in TARGET_SERIES:
            assert ("job", "=~") in matchers, selector.name
        elif selector.name in vllm_names:
            # vLLM's endpoint is another target: no kvmetrics instance to match.
            assert {("model_name", "=~"), ("engine", "=~")} <= matchers, selector.name
        else:
            assert {("model_name", "=~"), ("instance", "=~"), ("engine", "=~")} <= matchers, \
                selector.name
    ours = expr.replace(VLLM_FILTER, "")
    assert ours.count('model_name=~"$model_name"') == ours.count('engine=~"$engine"') \
        == ours.count('instance=~"$instance"')


@pytest.mark.parametrize(("title", "expr"), QUERIES, ids=[t for t, _ in QUERIES])
def test_ratios_show_no_data_rather_than_zero(title: str, expr: str) -> None:
    # A denominator of 0 (nothing looked up, nothing loaded) must drop the point, not
    # turn into a clamped 0 that colours the panel red.
    assert "clamp_min" not in expr
    for part in expr.split("\n/\n")[1:]:
        assert part.startswith("(") and part.rstrip().endswith("> 0)"), part


def test_hit_ratio_stats_use_first_admissions() -> None:
    for title in ("Local prefix hit ratio", "External prefix hit ratio"):
        (expr,) = [e for t, e in QUERIES if t == title]
        assert expr.count('admission="first"') == 2, expr


@pytest.mark.parametrize(("title", "expr"), QUERIES, ids=[t for t, _ in QUERIES])
def test_rates_use_rate_interval(title: str, expr: str) -> None:
    assert "$__interval" not in expr
    # Every rate() window is Grafana's $__rate_interval, never a fixed or too short one.
    assert expr.count("rate(") == expr.count("[$__rate_interval])")


def test_every_catalogue_family_is_on_the_dashboard() -> None:
    shown = {s.name for _, expr in QUERIES for s in selectors(substitute_grafana_vars(expr))}
    for spec in catalogue.ALL_METRICS:
        assert shown & set(spec.series_names()), f"{spec.name} has no panel"


def test_vllms_connector_series_have_panels() -> None:
    """Every series of the vLLM allow-list is shown, and only those of vLLM's."""
    vllm = {spec.name for spec in catalogue.VLLM_SERIES}
    shown = {s.name for _, expr in QUERIES for s in selectors(substitute_grafana_vars(expr))}
    assert vllm <= shown
    assert {n for n in shown if not n.startswith(catalogue.PREFIX)} - set(TARGET_SERIES) == vllm
    with pytest.raises(KeyError):
        vllm_sum_rate("vllm:external_prefix_cache_hits")  # missing _total


def test_substitution_rejects_unknown_variables() -> None:
    assert substitute_grafana_vars('x{a=~"${model_name}"}[$__rate_interval]') == 'x{a=~".*"}[1m]'
    with pytest.raises(ValueError, match="modelname"):
        substitute_grafana_vars('x{a=~"$modelname"}')


def test_selector_helper_rejects_unknown_names_and_values() -> None:
    with pytest.raises(KeyError):
        sel("kvmetrics_kv_load_blocks")  # missing _total
    with pytest.raises(ValueError):
        sel(catalogue.KV_LOAD_BLOCKS.name, outcome="fail")
    with pytest.raises(KeyError):
        sel(catalogue.KV_LOAD_BLOCKS.name, cause="capacity")
