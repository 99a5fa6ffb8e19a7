"""Dashboards and rules against a live Prometheus that scraped real lab runs (~60 s).

Two lab processes run through the real console script while Prometheus, loading
the shipped rule file, scrapes both: a healthy one and one reproducing the old
accounting bug (historical accounting, preemption and failed loads). Both wait
for Prometheus' first scrape before they start (``--wait-for-scrape``), so every
counter's first sample is 0, and they keep serving for a while after the end.

Evaluated at the healthy run's last scrape, over a window that covers the whole
run, ``increase()`` is then exactly the run's total and ``rate()`` that total
over the window: every dashboard panel's value must equal the figure the lab's
JSON summary gives for the same thing. A dashboard built with every ratio's
numerator and denominator swapped must fail that comparison. The negative-
increment alert must fire for the broken run only.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import yaml

from benchmarks.common import free_port
from dashboards import kv_cache_recovery
from dashboards.build import all_targets, variable_queries
from dashboards.queries import GRAFANA_VARS, ratio, substitute_grafana_vars
from kvmetrics import __version__
from kvmetrics.metrics import catalogue
from tests.helpers.prometheus import PrometheusServer, poll, running_prometheus
from tests.lab_support import REPO, console_script

pytestmark = pytest.mark.prometheus

RULES = REPO / "deploy" / "prometheus" / "rules.yml"
NUM_GPU_BLOCKS = 512
COMMON = ("--realtime", "--verify", "sampled", "--linger", "6", "--wait-for-scrape", "60",
          "--no-progress", "--max-requests", "200", "--json")
#: Sync loads only, so that the per-mode panels have one mode to compare with the totals.
CLEAN = ("--fault-rate", "0.1", "--fault-mode", "sync", "--num-gpu-blocks", str(NUM_GPU_BLOCKS))
HISTORICAL = ("--accounting", "historical", "--num-gpu-blocks", "150", "--fault-rate", "0.2",
              "--fault-mode", "sync")

Series = dict[str, str]
#: (panel title, legend) -> the expected value of a series of that target, from the summary.
Oracle = Callable[[dict[str, Any], Series, float], float | None]


@contextmanager
def lab_process(port: int, model_name: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [console_script(), "run", "--serve", f"127.0.0.1:{port}", "--model-name", model_name,
         *COMMON, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL, text=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()


def _recording_rules() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["record"] for group in groups for rule in group["rules"] if "record" in rule]


def _firing(prom: PrometheusServer, alertname: str) -> set[str]:
    return {a["labels"].get("model_name", "") for a in prom.alerts()
            if a["labels"].get("alertname") == alertname and a["state"] == "firing"}


# -- the oracle: what each panel must show, from the lab's JSON summary ---------------


def _per_s(total: float) -> Oracle:
    return lambda s, labels, window: total / window


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole else None  # None: the panel must show no data


_COMPUTED = {spec.name for spec in catalogue.COMPUTED_FAMILIES}


def _oracles(s: dict[str, Any]) -> dict[tuple[str, str], Oracle]:
    p, k, rec, ev = s["prefix_cache"], s["kv_load"], s["recomputed_tokens"], s["evicted_blocks"]
    prompt = sum(s["prompt_tokens"].values())
    req = s["requests"]
    by_reason = {"stopped": None, "length": None, "error": req["failed"],
                 "aborted": req["aborted"]}

    def admission(source: str, which: str) -> dict[str, int]:
        return p[source] if which == "first" else p[source]["repeat"]

    def hit_ratio(labels: Series) -> float | None:
        a = admission(labels["source"], labels["admission"])
        return _share(a["hit_tokens"], a["query_tokens"])

    def looked_up(key: str) -> Oracle:
        return lambda s_, labels, w: (p[labels["source"]][key]
                                      + p[labels["source"]]["repeat"][key]) / w

    def finished(s_: dict[str, Any], labels: Series, w: float) -> float | None:
        value = by_reason[labels["reason"]]
        return None if value is None else value / w  # stopped/length: summed apart below

    only_sync = {"mode": "sync", "policy": "recompute"}

    def loads(labels: Series, w: float) -> float:
        if labels["mode"] != "sync":
            return 0.0
        return (k["blocks_ok"] if labels["outcome"] == "ok" else k["blocks_failed"]) / w

    return {
        ("Local prefix hit ratio", ""): lambda *_: _share(p["local"]["hit_tokens"],
                                                          p["local"]["query_tokens"]),
        ("External prefix hit ratio", ""): lambda *_: _share(p["external"]["hit_tokens"],
                                                             p["external"]["query_tokens"]),
        ("Failed KV load blocks", ""): _per_s(k["blocks_failed"]),
        ("Rolled-back tokens", ""): _per_s(s["rolled_back_tokens"]),
        ("Recompute waste", ""): lambda *_: _share(sum(rec.values()), prompt),
        ("Guard rejections", ""): lambda *_: s["guard_rejected_increments"],
        ("Invariant violations", ""): lambda *_: s["invariant_violations"],
        ("Prefix hit ratio by source and admission", "{{source}} {{admission}}"):
            lambda s_, labels, w: hit_ratio(labels),
        ("Prefix lookups", "queried {{source}}"): looked_up("query_tokens"),
        ("Prefix lookups", "hit {{source}}"): looked_up("hit_tokens"),
        ("Prompt tokens by KV source", "{{source}}"):
            lambda s_, labels, w: s["prompt_tokens"][labels["source"]] / w,
        ("KV load blocks by mode and outcome", "{{mode}} {{outcome}}"):
            lambda s_, labels, w: loads(labels, w),
        ("KV load failure ratio by replica and mode", "{{instance}} {{mode}}"):
            lambda s_, labels, w: (_share(k["blocks_failed"], k["blocks_ok"] + k["blocks_failed"])
                                   if labels["mode"] == "sync" else None),
        ("Requests hit by failed loads", "{{mode}} {{policy}} {{action}}"):
            lambda s_, labels, w: (k["failed_requests"] / w if labels == {
                **only_sync, "action": "rescheduled"} else 0.0),
        ("Rolled-back tokens by mode and policy", "{{mode}} {{policy}}"):
            lambda s_, labels, w: s["rolled_back_tokens"] / w if labels == only_sync else 0.0,
        ("Recomputed tokens by cause", "{{cause}}"):
            lambda s_, labels, w: rec[labels["cause"]] / w,
        ("Evicted blocks by cause", "{{cause}}"): lambda s_, labels, w: ev[labels["cause"]] / w,
        ("Evictions caused by failed loads", "share"):
            lambda *_: _share(ev["kv_load_failure"], sum(ev.values())),
        ("Cache turnover per 5 minutes", "{{instance}} engine {{engine}}"):
            lambda s_, labels, w: ev["capacity"] / w * 300 / (NUM_GPU_BLOCKS - 1),
        # The run is over: no request is left and every block is free again.
        ("Requests by state", "{{state}}"): lambda *_: 0.0,
        ("KV cache usage", "{{instance}} {{model_name}} engine {{engine}}"): lambda *_: 0.0,
        ("Preemptions and finished requests", "preemptions"): _per_s(s["preemptions"]),
        ("Preemptions and finished requests", "finished {{reason}}"): finished,
        ("Verified KV tokens", "verified"): _per_s(s["verification"]["verified_tokens"]),
        ("KV verification failed blocks", "failed blocks"):
            _per_s(s["verification"]["failed_blocks"]),
        # One engine, named by what the run was: its version, kind and recovery path.
        ("kvmetrics build", "{{version}} {{engine_kind}} recovery={{recovery}}"):
            lambda s_, labels, w: 1.0 if labels == {
                "version": __version__, "engine_kind": s["engine"],
                "recovery": s["config"]["recovery"]} else None,
        ("Dropped series updates", "{{metric}}"): lambda *_: 0.0,
        # A single-process lab run has no multiprocess files to leave out.
        ("Dropped series updates", "scrape: {{reason}}"): lambda *_: 0.0,
        # The lab's engine hooks no vLLM method; the series exist at zero.
        ("vLLM hooks out of action", "{{hook}}"): lambda *_: 0.0,
        # Nor does it compare anything with vLLM's own figures; the series exist at zero.
        ("vLLM self-check failures", "{{check}}"): lambda *_: 0.0,
        # Nor does it time hooks: only vLLM's instrumented scheduler adds CPU seconds.
        ("kvmetrics overhead", "{{instance}} engine {{engine}}"): lambda *_: 0.0,
        # The reference engine computes every family, the verifier's too.
        ("Families live", "{{family}}"):
            lambda s_, labels, w: 1.0 if labels["family"] in _COMPUTED else None,
    }


#: Panels whose value no summary figure gives: they must return data, nothing more.
UNCHECKED = {"Recovery path duration", "Targets up", "Scrape duration", "Samples per scrape"}


def _mismatches(prom: PrometheusServer, targets: list[tuple[str, str, str]],
                summary: dict[str, Any], at: float, window: int) -> list[str]:
    variables = {**GRAFANA_VARS, "model_name": "clean", "__rate_interval": f"{window}s",
                 "__range": f"{window}s"}
    oracles = _oracles(summary)
    found: list[str] = []
    stopped_length = 0.0
    vllm_series = {spec.name for spec in catalogue.VLLM_SERIES}
    for title, legend, expr in targets:
        if any(name in expr for name in vllm_series):
            # vLLM's own series: the lab serves no vLLM endpoint (tests/test_serve_lmcache.py
            # and test_serve_nixl.py check these names on a real server's /metrics).
            continue
        plain = substitute_grafana_vars(expr, variables)
        result = prom.query(plain, at=at)
        if title in UNCHECKED:
            if not result:
                found.append(f"{title}: no data")
            continue
        oracle = oracles[(title, legend)]
        for item in result:
            labels = {k: v for k, v in item["metric"].items() if k != "__name__"}
            value = float(item["value"][1])
            if title == "Preemptions and finished requests" \
                    and labels.get("reason") in ("stopped", "length"):
                stopped_length += value
                continue
            expected = oracle(summary, labels, window)
            if expected is None or not math.isclose(value, expected, rel_tol=1e-9,
                                                    abs_tol=1e-9):
                found.append(f"{title} {labels}: {value} != {expected}")
        if not result:
            # No data is right only where the summary has nothing to divide by.
            expected = oracle(summary, {}, window) if legend == "" else "series"
            if expected is not None:
                found.append(f"{title}: no data, expected {expected}")
    finished = summary["requests"]["finished"] / window
    if not math.isclose(stopped_length, finished, rel_tol=1e-9):
        found.append(f"finished stopped+length: {stopped_length} != {finished}")
    return found


def _last_scrape(prom: PrometheusServer, model_name: str) -> float:
    (series,) = prom.query(f'kvmetrics_build_info{{model_name="{model_name}"}}[10m]')
    return max(float(t) for t, _ in series["values"])


def test_dashboards_rules_and_alerts_against_live_lab_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clean_port, broken_port = free_port(), free_port()
    with ExitStack() as stack:
        prom = stack.enter_context(running_prometheus(
            [f"127.0.0.1:{clean_port}", f"127.0.0.1:{broken_port}"], rule_files=[RULES]))
        started = time.time()
        clean = stack.enter_context(lab_process(clean_port, "clean", *CLEAN))
        stack.enter_context(lab_process(broken_port, "broken", *HISTORICAL))

        out, _ = clean.communicate(timeout=240)
        assert clean.returncode == 0
        summary = json.loads(out)
        at = _last_scrape(prom, "clean")
        window = math.ceil(at - started) + 5  # reaches back before the first (zero) sample

        # Every panel shows what the summary says, at the run's end.
        assert _mismatches(prom, all_targets(), summary, at, window) == []
        # The comparison can fail: swap every ratio's numerator and denominator.
        monkeypatch.setattr(kv_cache_recovery, "ratio", lambda n, d: ratio(d, n))
        swapped = _mismatches(prom, all_targets(), summary, at, window)
        monkeypatch.undo()
        assert any(m.startswith("Local prefix hit ratio") for m in swapped), swapped
        assert any(m.startswith("KV load failure ratio") for m in swapped), swapped
        # The run did exercise the recovery path the panels are about.
        assert summary["kv_load"]["blocks_failed"] > 0 and summary["rolled_back_tokens"] > 0

        # Variables and recording rules return data for the scraped runs.
        empty = [name for name, expr in variable_queries()
                 if not prom.query(substitute_grafana_vars(expr), at=at)]
        empty += [name for name in _recording_rules() if not prom.query(name, at=at)]
        assert empty == []

        poll(lambda: "broken" in _firing(prom, "KVMetricsCounterViolation") or None, 60,
             "KVMetricsCounterViolation firing for the historical run")
        assert _firing(prom, "KVMetricsCounterViolation") == {"broken"}
        rejected = prom.query('sum by (reason) (kvmetrics_guard_rejected_increments_total'
                              '{model_name="broken"})', at=_last_scrape(prom, "broken"))
        assert {v["metric"]["reason"] for v in rejected if float(v["value"][1]) > 0} \
            == {"negative"}
        assert prom.query('sum(kvmetrics_guard_rejected_increments_total{model_name="clean"})',
                          at=at)[0]["value"][1] == "0"
        assert "clean" not in _firing(prom, "KVMetricsKVVerificationFailures")
        # The lab hooks no vLLM and runs no vLLM code: nothing that blinds the alerts.
        for blind_spot in ("KVMetricsInstrumentationErrors", "KVMetricsVLLMUnverified",
                           "KVMetricsFamilyAbsent"):
            assert _firing(prom, blind_spot) == set(), blind_spot
        (live,) = prom.query('count(kvmetrics_family_live{model_name="clean"} == 1)', at=at)
        assert float(live["value"][1]) == len(_COMPUTED)
