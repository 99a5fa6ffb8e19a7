"""A real Prometheus server scrapes the exporter while engines run (about 10 s)."""

from __future__ import annotations

import json
import logging
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvmetrics.exporters.admission import ServerLimits
from kvmetrics.exporters.prometheus import PrometheusSink, serve
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.metrics import Series, counters_from_query, pipeline_counters
from tests.helpers.prometheus import PrometheusError, PrometheusServer, running_prometheus
from tests.helpers.runs import exporter_phases

pytestmark = pytest.mark.prometheus


def _sum_by_labels(prom: PrometheusServer, at: float | None = None) -> Series:
    """Every catalogue counter as Prometheus sees it, summed over instance and job."""
    results = {}
    for spec in cat.COUNTERS:
        labels = ", ".join((*spec.labels, *spec.open_labels))
        results[spec.name] = prom.query(f"sum by ({labels}) ({spec.name})", at=at)
    return counters_from_query(results)


def _violation_rule(folder: Path) -> Path:
    path = folder / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "kvmetrics-test", "rules": [{
        "alert": "KVMetricsTestViolation",
        "expr": "increase(kvmetrics_guard_rejected_increments_total[1m]) > 0",
    }]}]}))  # JSON is YAML
    return path


def test_prometheus_scrapes_the_same_totals_as_the_pipeline_during_and_after_a_run(
    tmp_path: Path,
) -> None:
    sink = PrometheusSink(CollectorRegistry())
    pipeline = MetricsPipeline([sink])
    # A scrape sees values at most page_max_age_s old (the endpoint's page cache): the
    # scrapes compared below start at least that long after the phase they check.
    limits = ServerLimits()
    page_age = limits.page_max_age_s
    server = serve(sink.registry, port=0, limits=limits)
    target = f"{server.host}:{server.port}"
    try:
        with running_prometheus(target, rule_files=[_violation_rule(tmp_path)]) as prom:
            prom.wait_for_scrape(after=0)
            first, second, violating = exporter_phases(pipeline)

            first()
            mid_totals = pipeline_counters(pipeline)
            # A scrape whose page was collected after phase one.
            mid_scrape = prom.wait_for_scrape(after=time.time() + page_age)
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as response:
                healthy_page = response.read().decode()
            # The guard's and the invariants' counters exist from the first scrape, at 0.
            for spec in (cat.GUARD_REJECTED_INCREMENTS, cat.INVARIANT_VIOLATIONS):
                assert prom.query_value(f"count({spec.name})") == len(
                    cat.bounded_label_sets(spec))
                assert prom.query_value(f"sum({spec.name})") == 0

            assert prom.alerts() == []

            second()
            logging.disable(logging.ERROR)  # the last phase's violation is logged on purpose
            try:
                violating()
            finally:
                logging.disable(logging.NOTSET)
            prom.wait_for_scrape(after=time.time() + page_age)

            assert prom.query_value(f'up{{job="kvmetrics", instance="{target}"}}') == 1
            # Mid-run: what Prometheus stored at the scrape between the phases.
            assert _sum_by_labels(prom, at=mid_scrape) == mid_totals
            # After the run: the final totals, violations included.
            final = _sum_by_labels(prom)
            assert final == pipeline_counters(pipeline)
            assert final != mid_totals
            assert final[(cat.GUARD_REJECTED_INCREMENTS.name,
                          ("kvmetrics_prompt_tokens_total", "negative"))] == 1
            assert prom.query_value("sum(kvmetrics_recovery_duration_seconds_count)") \
                == prom.query_value('sum(kvmetrics_recovery_duration_seconds_bucket{le="+Inf"})') \
                > 0
            names = {item["metric"]["__name__"]
                     for item in prom.query('group by (__name__) ({__name__=~"kvmetrics_.*"})')}
            # No _created series; every counter (overflow included) is on the page.
            assert names <= cat.exported_series_names()
            assert {s.name for s in cat.COUNTERS} <= names
            alert = prom.wait_for_alert("KVMetricsTestViolation")
            assert alert["labels"]["metric"] == "kvmetrics_prompt_tokens_total"
            assert alert["labels"]["reason"] == "negative"
            process = prom.process
        assert process.poll() is not None  # the helper stopped the server
    finally:
        server.stop()

    result = subprocess.run(["promtool", "check", "metrics"], input=healthy_page,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_helper_reports_why_prometheus_did_not_start(tmp_path: Path) -> None:
    bad = tmp_path / "rules.yml"
    bad.write_text("groups:\n- name: x\n  rules:\n  - alert: A\n    expr: sum(\n")
    with pytest.raises(PrometheusError, match="unclosed left parenthesis"), \
            running_prometheus("127.0.0.1:9", rule_files=[bad]):
        pass
