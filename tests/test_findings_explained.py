"""Findings explained: each known reproduction of stale KV is attributed to its cause.

The scenarios are the verifier's own (tests/test_kv_recovery.py, built by hand so
that a request really reads the block in question, and tests/test_vllm_verifier.py
on vLLM's real scheduler); here the data plane's provenance must name the event
that made the KV bad and the lab must turn it into the known cause, the docs
section and the option that avoids it, or say that the cause is unknown.
"""

from __future__ import annotations

import json
import re

import pytest

import kvmetrics.lab.engine.request as request_module
from kvmetrics.lab.config import LabConfig
from kvmetrics.lab.engine.faults import FaultPlan, ScriptedFailure
from kvmetrics.lab.findings import DOCS_SHARERS, DOCS_STALE, classify, explain_findings
from kvmetrics.lab.kv.harness import Job, build_engine, drive, populate_store
from tests.lab_support import run_cli
from tests.test_kv_recovery import (
    A_PROMPT,
    BS,
    OTHER,
    PREFIX,
    S_PROMPT,
    _admit,
    _engine,
    _failed_block,
    _no_truncation,
    _tokens,
)
from tests.test_lab_report import STALE


def _causes(engine, policy: str) -> list[str]:
    runner = engine.runner
    assert len(runner.attributions) == len(runner.findings) > 0
    return [classify(a, policy).key for a in runner.attributions]


def test_owner_aborted_before_recompute() -> None:
    engine = _engine("recompute", "cpu")
    _admit(engine, Job("A", A_PROMPT, 3))
    bad = _failed_block(engine)
    failed_at = engine.scheduler.step
    assert engine.scheduler.abort("A")  # before the next step, as the lab aborts
    drive(engine, [Job("C", S_PROMPT, 3)])
    assert set(_causes(engine, "recompute")) == {"stale_failed_block"}
    first = engine.runner.attributions[0]
    assert (first.taint.kind, first.taint.request_id, first.taint.block_index) == \
        ("failed_load", "A", 1)
    assert [f.what for f in first.owner_fates] == ["finished"]
    summary = explain_findings(LabConfig(policy="recompute"), engine.runner.findings,
                               engine.runner.attributions, aborted={"A": failed_at + 1})
    (cause,) = summary["causes"]
    assert cause["known"] and cause["docs"] == DOCS_STALE and cause["avoid"] == "--recovery evict"
    assert summary["requests"] == 1 and summary["blocks"] == 1
    assert f"block {bad} (#1 of its table)" in cause["example"]
    assert (f"load failed at step {failed_at} for request A; A was aborted at step "
            f"{failed_at + 1} before recomputing it") in cause["example"]


def test_owner_preempted_before_recompute() -> None:
    engine = _engine("recompute", "cpu", num_gpu_blocks=9)
    _admit(engine, Job("R", OTHER, 8))
    engine.loop.step()
    _admit(engine, Job("A", A_PROMPT, 3))
    _failed_block(engine)
    out = engine.loop.step()
    assert out.preempted_req_ids == {"A"}
    drive(engine, [])
    assert set(_causes(engine, "recompute")) == {"stale_failed_block"}
    fates = engine.runner.attributions[0].owner_fates
    assert fates[0].what == "preempted" and fates[0].step == out.step


def test_sharer_blocks_under_fail() -> None:
    engine = _engine("fail", "cpu", save_policy="discard-aware")
    _admit(engine, Job("A", A_PROMPT, 3), Job("S", S_PROMPT, 3))
    engine.loop.step()
    drive(engine, [])
    drive(engine, [Job("U", PREFIX + _tokens(3), 2)])
    drive(engine, [Job("T", S_PROMPT, 3)])
    assert set(_causes(engine, "fail")) == {"sharer_blocks_hashed"}
    taint = engine.runner.attributions[0].taint
    assert (taint.kind, taint.request_id, taint.root.request_id) == ("discarded_read", "S", "A")
    summary = explain_findings(LabConfig(policy="fail"), engine.runner.findings,
                               engine.runner.attributions, aborted={})
    assert summary["causes"][0]["docs"] == DOCS_SHARERS


def test_poisoned_save_loaded_back_from_the_store() -> None:
    engine = _engine("fail", "cpu", save_policy="owner-only")
    _admit(engine, Job("A", A_PROMPT, 3), Job("S", S_PROMPT, 3))
    engine.loop.step()
    drive(engine, [])
    drive(engine, [Job("T", S_PROMPT, 3)])
    assert set(_causes(engine, "fail")) == {"poisoned_save"}
    taint = engine.runner.attributions[0].taint
    assert taint.kind == "from_store" and taint.root.request_id == "A"


def test_a_skipped_rollback_is_not_blamed_on_a_known_cause(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The owner kept its failed block without being preempted or aborted: not one of
    vLLM's known holes, so the explanation must say unknown."""
    _no_truncation(monkeypatch)
    engine = _engine("recompute", "cpu")
    _admit(engine, Job("A", A_PROMPT, 3))
    _failed_block(engine)
    drive(engine, [])
    assert set(_causes(engine, "recompute")) == {"unknown"}


def test_a_hash_bug_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    real = request_module.hash_block
    monkeypatch.setattr(request_module, "hash_block",
                        lambda parent, key, extra=b"": real(parent, key[:9], extra))
    engine = build_engine(block_size=BS, device="cpu", store_blocks=0)
    drive(engine, [Job("X", (1, 2, 3, 4, 5, 6, 7, 8, 9), 2),
                   Job("Y", (1, 9, 9, 9, 5, 9, 9, 9, 9), 2, arrival=3)])
    assert set(_causes(engine, "recompute")) == {"unknown"}
    assert all(a.taint is None for a in engine.runner.attributions)


def test_a_recomputed_block_is_no_longer_tainted() -> None:
    """The owner recomputes its failed block (ample memory, nobody preempted): the block
    is wholly rewritten with good KV, so its provenance is cleared."""
    engine = build_engine(block_size=BS, device="cpu", policy="recompute",
                          faults=FaultPlan(scripted=(ScriptedFailure(1, "A"),)))
    populate_store(engine, PREFIX + _tokens(BS))
    _admit(engine, Job("A", A_PROMPT, 3))
    bad = _failed_block(engine)
    assert engine.runner.provenance.blocks[bad].kind == "failed_load"
    drive(engine, [Job("C", S_PROMPT, 3, arrival=4)])
    assert engine.runner.findings == []
    assert bad not in engine.runner.provenance.blocks


@pytest.mark.vllm
def test_vllm_preempted_owner_is_attributed() -> None:
    from tests.test_vllm_verifier import preempted_owner_run

    _, runner, _ = preempted_owner_run("recompute")
    assert {(f.request_id, f.block_index) for f in runner.findings} == {("a", 1), ("c", 1)}
    causes = {classify(a, "recompute").key for a in runner.attributions}
    assert causes == {"stale_failed_block"}
    assert {a.taint.request_id for a in runner.attributions} == {"a"}
    assert all(any(f.what == "preempted" for f in a.owner_fates) for a in runner.attributions)


def test_lab_summary_explains_the_stale_reads() -> None:
    text = run_cli("run", *STALE)
    assert text.returncode == 3, text.stderr  # stale reads exit 3 ...
    assert "the verifier found" in text.stderr and "Traceback" not in text.stderr
    allowed = run_cli("run", *STALE, "--allow-stale-reads")
    assert allowed.returncode == 0, allowed.stderr  # ... unless allowed
    assert re.search(r"stale KV: \d+ stale block reads by \d+ request\(s\) in \d+ distinct "
                     r"block\(s\), first at step \d+", text.stdout)
    assert DOCS_STALE in text.stdout and "avoid it with --recovery evict" in text.stdout
    result = run_cli("run", *STALE, "--json")
    summary = json.loads(result.stdout)
    findings = summary["findings"]
    assert findings["failed_blocks"] == summary["verification"]["failed_blocks"] > 0
    # The table's last line judges the run, with the counts the JSON has ...
    assert text.stdout.endswith(
        f"\n\nverdict: FAIL - {findings['failed_blocks']:,} stale KV block reads by "
        f"{findings['requests']:,} requests: KV that differs from a clean computation was "
        "read\n"), text.stdout[-600:]
    # ... and the figure that looks wrong (more recomputed than rolled back) says why.
    rolled, again = summary["rolled_back_tokens"], summary["recomputed_tokens"]["kv_load_failure"]
    assert again > rolled
    assert re.search(rf"^recomputed tokens +{again:,} after failed loads\*, ", text.stdout, re.M)
    assert (f"\n* {again:,} tokens recomputed after failed loads, more than the {rolled:,} "
            "rolled back: a failed step's own tokens are discarded and computed again without "
            "a rollback, and a request preempted before it caught up computes them once more\n"
            ) in text.stdout
    assert sum(c["failed_blocks"] for c in findings["causes"]) == findings["failed_blocks"]
    assert all(c["known"] for c in findings["causes"])
    fixed = json.loads(run_cli("run", *STALE, "--json", "--recovery", "evict").stdout)
    assert fixed["findings"] == {"failed_blocks": 0, "requests": 0, "blocks": 0, "first_step": None,
                                 "causes": []}


def test_guard_rejections_name_metric_step_and_request() -> None:
    """The historical accounting's negative increments: the summary's groups agree with
    the guard's own log lines (one per rejection) on count, first step and request, and
    with the exported counters on the count."""
    from tests.test_lab_runs import HISTORICAL

    result = run_cli("run", "--verify", "off", "--json", *HISTORICAL)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    logged = re.findall(r"refused (\S+) increment of (kvmetrics_\w+) at step (\d+)"
                        r"(?: request=(\S+))?:", result.stderr)
    assert logged and len(logged) == summary["guard_rejected_increments"]
    rejections = [g for g in summary["violations"] if g["kind"] == "guard_rejection"]
    assert sum(g["count"] for g in rejections) == len(logged)
    for g in rejections:
        mine = [e for e in logged if (e[0].replace("-", "_"), e[1]) == (g["reason"], g["metric"])]
        assert g["count"] == len(mine)
        assert (g["first_step"], g["first_request"]) == (int(mine[0][2]), mine[0][3] or None)
    invariants = [g for g in summary["violations"] if g["kind"] == "invariant"]
    assert sum(g["count"] for g in invariants) == summary["invariant_violations"]
    text = run_cli("run", "--verify", "off", *HISTORICAL).stdout
    g = rejections[0]
    assert (f"negative increments of {g['metric']} rejected by the guard: {g['count']} "
            f"time(s), first at step {g['first_step']}, first request {g['first_request']}"
            ) in text
