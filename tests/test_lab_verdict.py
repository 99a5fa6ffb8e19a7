"""The summary's last line and its labels, as a person reads them at the end of a run: the
verdict, the faults injected and the recovery run (the stale-read FAIL and the PASS of the
default job are checked where those runs happen: tests/test_findings_explained.py and
tests/test_readme_commands.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvmetrics.lab.config import LabConfig
from kvmetrics.lab.runner import run_lab
from kvmetrics.lab.summary import render_table, summary_rows
from tests.lab_support import run_cli
from tests.test_lab_runs import HISTORICAL


def _row(stdout: str, name: str) -> str:
    found = re.search(rf"^{re.escape(name)}  +(.*)$", stdout, flags=re.M)
    assert found, stdout
    return found[1]


def test_historical_accounting_notes_its_expected_violations() -> None:
    result = run_cli("run", "--verify", "off", "--max-requests", "60", *HISTORICAL)
    assert result.returncode == 0, result.stderr
    *_, blank, last = result.stdout.rstrip("\n").splitlines()
    broken, rejected = _row(result.stdout, "invariant violations"), \
        _row(result.stdout, "guard rejected increments")
    assert int(broken) > 0 and int(rejected) > 0
    assert blank == ""
    assert last == (f"verdict: NOT VERIFIED - --verify off: stale KV reads cannot be seen; "
                    f"{broken} invariant violation{'s' * (broken != '1')} and {rejected} guard "
                    f"rejection{'s' * (rejected != '1')}, expected under --accounting historical")
    assert _row(result.stdout, "failure policy") == (
        "--policy recompute: a request whose load failed computes the lost blocks again")
    assert _row(result.stdout, "recovery path") == (
        "--recovery vllm: vLLM's own recovery path, its known defects included")


def test_broken_counters_fail_the_verdict_and_a_cut_run_says_so() -> None:
    result = run_lab(LabConfig(max_requests=20, progress=False, verify="sampled"))
    document = result.document()
    text = render_table(document)
    assert text.endswith("\n\nverdict: PASS - no request read stale KV ("
                         f"{document['verification']['verified_tokens']:,} tokens verified, "
                         "a sample of requests)")
    # What a kvmetrics bug would show: the run's counters broke an invariant.
    document["invariant_violations"] = 3
    assert render_table(document).endswith(
        "\n\nverdict: FAIL - no request read stale KV, but the counters had 3 invariant "
        "violations")
    # A run cut short says its figures are partial, on the same line.
    document["interrupted"] = "SIGINT"
    assert render_table(document).endswith(
        "violations; a partial run: interrupted by SIGINT")


def test_a_fault_plan_is_named_instead_of_the_rate_it_replaces(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"rate": 0.3, "seed": 1, "failures": []}))
    result = run_cli("run", "--verify", "off", "--max-requests", "150", "--fault-plan",
                     str(plan))
    assert result.returncode == 0, result.stderr
    assert _row(result.stdout, "faults injected") == (
        f"as --fault-plan {plan} lists them (its own rate and failures; --fault-rate does "
        "not apply)")
    loads = re.fullmatch(r"([\d,]+) ok, ([\d,]+) failed \([\d.]+% of loaded blocks; injected: "
                         r"the fault plan's\); [\d,]+ requests hit by a failed load",
                         _row(result.stdout, "KV load blocks"))
    assert loads and int(loads[2].replace(",", "")) > 0, result.stdout


def test_every_summary_figure_reads_without_the_docs() -> None:
    """Counts grouped in thousands, ratios as percentages, label values in words: a
    newcomer reads each row without metrics.md at hand."""
    document = run_lab(LabConfig(max_requests=20, progress=False, verify="off")).document()
    local = document["prefix_cache"]["local"]
    local.update(hit_tokens=55216, query_tokens=128787, hit_ratio=55216 / 128787)
    local["repeat"].update(hit_tokens=768, query_tokens=1032)
    document["evicted_blocks"] = {"capacity": 4347, "kv_load_failure": 2, "reset": 0}
    document["kv_load"].update(blocks_ok=1642, blocks_failed=9, failed_requests=9)
    document["rolled_back_tokens"] = 1960
    rows = dict(summary_rows(document))
    assert rows["local prefix hits"] == (
        "55,216/128,787 tokens on first admission (42.9%), 768/1,032 on re-admission (after "
        "a preemption or a failed async load)")
    assert rows["evicted blocks"] == (
        "4,347 to make room, 2 after failed loads, 0 by a prefix-cache reset")
    assert rows["KV load blocks"].startswith("1,642 ok, 9 failed (0.5% of loaded blocks")
    assert rows["KV load blocks"].endswith("; 9 requests hit by a failed load")
    assert rows["rolled back tokens"].startswith("1,960 ")
    # No count of four digits or more without its thousands separator, anywhere.
    bare = [v for v in rows.values() if re.search(r"(?<![\d.,])\d{4,}(?![\d])", v)]
    assert not bare, bare
