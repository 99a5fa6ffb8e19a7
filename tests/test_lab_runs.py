"""Whole lab runs: the default job, historical accounting, summary == exported counters."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmetrics.lab.config import LabConfig
from kvmetrics.lab.runner import run_lab
from kvmetrics.metrics import catalogue as cat
from tests.lab_support import run_cli

pytestmark = pytest.mark.vllm

#: Preemption pressure plus frequent sync load failures: the old accounting breaks.
HISTORICAL = ("--accounting", "historical", "--num-gpu-blocks", "150", "--fault-rate", "0.2",
              "--fault-mode", "sync")


def test_default_run_is_clean() -> None:
    result = run_cli("run", "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no warning (torch's NumPy one included)
    summary = json.loads(result.stdout)
    assert summary["guard_rejected_increments"] == summary["invariant_violations"] == 0
    assert summary["verification"]["failed_blocks"] == 0
    assert summary["verification"]["verified_tokens"] > 0
    assert summary["kv_load"]["blocks_failed"] > 0
    assert summary["recomputed_tokens"]["kv_load_failure"] > 0
    assert summary["preemptions"] > 0
    assert summary["requests"]["submitted"] == 300
    assert summary["requests"]["finished"] == 300


def test_default_run_prints_a_table() -> None:
    result = run_cli("run", "--verify", "off", "--max-requests", "20")
    assert result.returncode == 0, result.stderr
    assert "local prefix hits" in result.stdout
    assert "guard rejected increments" in result.stdout
    assert "invariant violations" in result.stdout


def test_historical_accounting_counts_violations_but_completes() -> None:
    result = run_cli("run", "--verify", "off", "--json", *HISTORICAL)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["guard_rejected_increments"] > 0
    assert summary["requests"]["finished"] == summary["requests"]["submitted"]
    assert "refused negative increment of kvmetrics_" in result.stderr


def test_strict_makes_historical_accounting_fail_and_keeps_what_ran(tmp_path) -> None:
    """A --strict stop ends the run at the first refused increment; the steps run so far
    are still summarised, written to --output and --report, with the reason."""
    out, page = tmp_path / "run.json", tmp_path / "run.html"
    result = run_cli("run", "--verify", "off", "--strict", "--json", "--output", str(out),
                     "--report", str(page), *HISTORICAL)
    assert result.returncode == 1
    assert "strict mode" in result.stderr
    assert "Traceback" not in result.stderr
    saved = json.loads(out.read_text())
    assert saved["stopped"].startswith("strict mode: ")
    assert saved["guard_rejected_increments"] == 1  # stopped at the first one
    assert saved["steps"] == json.loads(result.stdout)["steps"] > 0
    assert saved["requests"]["finished"] < saved["requests"]["submitted"]
    assert "partial run: strict mode: " in page.read_text()


def _scraped_counters(page: str) -> dict[tuple[str, tuple[str, ...]], float]:
    values: dict[tuple[str, tuple[str, ...]], float] = {}
    for family in text_string_to_metric_families(page):
        spec = cat.BY_NAME.get(family.name + "_total")
        if spec is None or spec.kind != "counter":
            continue
        own = (*spec.labels, *spec.open_labels)
        for sample in family.samples:
            if sample.name == spec.name:
                values[(spec.name, tuple(sample.labels[k] for k in own))] = sample.value
    return values


def test_summary_equals_exported_counters() -> None:
    result = run_lab(LabConfig(verify="off", fault_rate=0.1, progress=False, max_requests=120))
    scraped = _scraped_counters(result.prometheus.render().decode())
    assert {k: v for k, v in scraped.items() if v} == result.pipeline.totals.series()
    # Bounded series exist from the start, at zero, so rate() sees first increments.
    assert scraped[(cat.KV_LOAD_FAILED_REQUESTS.name, ("async", "fail", "failed"))] == 0
    s = result.summary
    total = result.pipeline.totals.get
    assert s["rolled_back_tokens"] == total(cat.ROLLED_BACK_TOKENS)
    assert s["kv_load"]["blocks_failed"] == total(cat.KV_LOAD_BLOCKS, outcome="failed")
    assert s["preemptions"] == total(cat.PREEMPTIONS)
    assert s["prefix_cache"]["local"]["hit_tokens"] == total(
        cat.PREFIX_CACHE_HIT_TOKENS, source="local", admission="first")


def test_same_seed_same_summary() -> None:
    a = run_lab(LabConfig(verify="off", progress=False, max_requests=80, seed=7)).summary
    b = run_lab(LabConfig(verify="off", progress=False, max_requests=80, seed=7)).summary
    a.pop("wall_seconds")
    b.pop("wall_seconds")
    assert a == b


def test_aborts_are_counted() -> None:
    s = run_lab(LabConfig(verify="off", progress=False, max_requests=100,
                          abort_rate=0.3)).summary
    r = s["requests"]
    assert r["aborted"] > 0
    assert r["finished"] + r["failed"] + r["aborted"] == r["submitted"]


def test_a_stalled_run_still_writes_its_outputs(tmp_path) -> None:
    """vLLM 0.33's stall after failed async loads (reproduced by the reference engine,
    docs/vllm-defects.md ``async-load-stall``) ends the run with exit 1; the summary of
    the steps run, --output and --report are still written, saying where it stalled."""
    from kvmetrics.lab.vllm.differential import random_workload

    workload = random_workload(0, 40, load_mode="async", doc_blocks=(2, 4), suffix=(1, 20))
    trace = tmp_path / "stall.jsonl"
    trace.write_text("".join(
        json.dumps({"id": s.request_id, "arrival_s": i * 0.04,
                    "prompt_token_ids": list(s.tokens), "output_length": s.max_tokens}) + "\n"
        for i, s in enumerate(workload.requests)))
    out, page = tmp_path / "run.json", tmp_path / "run.html"
    result = run_cli("run", "--trace", str(trace), "--block-size", "16", "--num-gpu-blocks",
                     "12", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                     "--fault-mode", "async", "--fault-rate", "0.5", "--verify", "off",
                     "--json", "--output", str(out), "--report", str(page))
    assert result.returncode == 1, result.stderr
    assert "the reference engine stalled" in result.stderr
    assert "Traceback" not in result.stderr
    saved = json.loads(out.read_text())
    assert saved["stalled"].startswith("the reference engine stalled")
    assert saved["steps"] == json.loads(result.stdout)["steps"] > 1000
    assert saved["requests"]["finished"] < 40
    assert "<svg" in page.read_text()
    assert "partial run: the reference engine stalled" in page.read_text()
