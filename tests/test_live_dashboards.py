"""Dashboards and rules against a live Prometheus that scraped real lab runs (~40 s).

Two lab processes run at once through the real console script: a healthy one
(unified accounting) and one reproducing the old accounting bug (historical,
with preemption and failed loads). Prometheus, loading the shipped rule file,
scrapes both. Every dashboard query and every recording rule must return data,
and the negative-increment alert must fire for the broken run only.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import yaml

from dashboards.build import all_queries, variable_queries
from dashboards.queries import substitute_grafana_vars
from tests.helpers.prometheus import PrometheusServer, free_port, poll, running_prometheus
from tests.lab_support import REPO, console_script

RULES = REPO / "deploy" / "prometheus" / "rules.yml"
COMMON = ("--realtime", "--verify", "sampled", "--fault-rate", "0.1", "--linger", "90",
          "--no-progress", "--max-requests", "200")
HISTORICAL = ("--accounting", "historical", "--num-gpu-blocks", "150", "--fault-rate", "0.2",
              "--fault-mode", "sync")


@contextmanager
def lab_process(model_name: str, *args: str) -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [console_script(), "run", "--serve", f"127.0.0.1:{port}", "--model-name", model_name,
         *COMMON, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()


def _recording_rules() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["record"] for group in groups for rule in group["rules"] if "record" in rule]


def _empty_queries(prom: PrometheusServer) -> list[str]:
    queries = [(title, substitute_grafana_vars(expr)) for title, expr in all_queries()]
    queries += [(f"variable {name}", substitute_grafana_vars(expr))
                for name, expr in variable_queries()]
    queries += [(f"recording rule {name}", name) for name in _recording_rules()]
    return [f"{title}: {expr}" for title, expr in queries if not prom.query(expr)]


def _firing(prom: PrometheusServer, alertname: str) -> set[str]:
    return {a["labels"].get("model_name", "") for a in prom.alerts()
            if a["labels"].get("alertname") == alertname and a["state"] == "firing"}


def test_dashboards_rules_and_alerts_against_live_lab_runs() -> None:
    with ExitStack() as stack:
        clean = stack.enter_context(lab_process("clean"))
        broken = stack.enter_context(lab_process("broken", *HISTORICAL))
        prom = stack.enter_context(running_prometheus([clean, broken], rule_files=[RULES]))
        prom.wait_for_scrape(timeout=60)
        # Let the runs progress under scraping, so rates and ratios have samples.
        time.sleep(8)
        try:
            poll(lambda: _empty_queries(prom) == [] or None, 60,
                 "every dashboard query and recording rule to return data")
        finally:
            assert _empty_queries(prom) == []

        poll(lambda: "broken" in _firing(prom, "KVMetricsCounterViolation") or None, 60,
             "KVMetricsCounterViolation firing for the historical run")
        assert _firing(prom, "KVMetricsCounterViolation") == {"broken"}
        violations = prom.query('sum by (kind) (kvmetrics_counter_violations_total'
                                '{model_name="broken"})')
        assert {v["metric"]["kind"] for v in violations} >= {"negative"}
        assert not prom.query('kvmetrics_counter_violations_total{model_name="clean"}')
        # The broken run's preemption pressure under policy recompute also trips the
        # stale-block reads of vLLM's recovery semantics (docs/vllm.md), which the
        # verifier reports; the healthy run reads no bad KV.
        assert "clean" not in _firing(prom, "KVMetricsKVVerificationFailures")
