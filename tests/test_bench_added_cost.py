"""The added-cost benchmark's design and verdicts (``benchmarks/vllm_added_cost.py``):
a balanced order, a verdict only when the A/A control holds 0 across two processes,
kvmetrics' gauge cadence at the stated server step, and one-line errors. Times are not
asserted: only what the method promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.added_cost_design import (
    BATCHES,
    Estimate,
    balanced_order,
    combined,
    follows,
    verdict,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("modes", [1, 2, 5, 6, 8])
def test_every_mode_follows_every_mode_equally_often(modes: int) -> None:
    order = balanced_order(modes)
    assert [order.count(m) for m in range(modes)] == [modes] * modes
    pairs = follows(order)
    assert pairs == {(a, b): 1 for a in range(modes) for b in range(modes)}


def test_a_verdict_needs_two_processes_and_an_aa_control_that_holds_0() -> None:
    below, above = Estimate(-3.0, -5.0, -1.0), Estimate(3.0, 1.0, 5.0)
    good, off = Estimate(0.2, -1.0, 1.4), Estimate(2.0, 0.5, 3.5)
    assert verdict(below, [good, good]) == ("resolved", True)
    assert verdict(above, [good, good]) == ("resolved", False)
    assert verdict(Estimate(0.0, -1.0, 1.0), [good, good])[1] is None
    assert verdict(below, [good, off]) == ("unresolved (A/A control off)", None)
    assert verdict(below, [good]) == ("unresolved (one process)", None)
    # The processes' spread is in the interval: it spans every process's.
    both = combined([Estimate(1.0, 0.5, 1.5), Estimate(3.0, 2.8, 3.2)])
    assert (both.us, both.low, both.high) == (2.0, 0.5, 3.2)


def _result(control: float, minus: float, added: float = 2.0) -> dict[str, object]:
    """A worker's result with constant batch differences but for a +-0.5 spread."""
    def batches(centre: float) -> list[float]:
        return [centre + (0.5 if i % 2 else -0.5) for i in range(BATCHES)]

    return {"running": 16, "cycles": 80, "step_ms": 10.0, "vllm_us": 200.0,
            "diffs": {"control": batches(control), "stats": batches(added - minus),
                      "frame": batches(1.0), "added": batches(added),
                      "minus": batches(minus), "carry_kvmetrics": batches(0.0),
                      "carry_stats": batches(0.0)},
            "kv_steps": 96, "recorded": 3, "recorded_us": 120.0, "after_us": 30.0,
            "reported_us": 1.0, "sampled_us": 0.8, "evict_us": 0.1, "timed_us": 0.1}


def test_the_table_prints_no_verdict_when_the_aa_control_is_off() -> None:
    from benchmarks.vllm_added_cost import size_rows

    def minus_row(results: list[dict[str, object]]):  # noqa: ANN202
        return next(r for r in size_rows(results)
                    if r.benchmark == "kvmetrics added - vLLM's own stats")

    resolved = minus_row([_result(0.0, -5.0), _result(0.1, -4.0)])
    assert (resolved.target, resolved.ok) == ("<= 0: resolved", True)
    off = minus_row([_result(0.0, -5.0), _result(3.0, -4.0)])
    assert (off.target, off.ok) == ("<= 0: unresolved (A/A control off)", None)
    alone = minus_row([_result(0.0, -5.0)])
    assert alone.ok is None and "one process" in alone.target


@pytest.mark.vllm
def test_kvmetrics_reads_its_gauges_at_the_server_cadence_not_the_simulators() -> None:
    """At 10 ms a decode step the 0.25 s gauge floor falls on every 32nd kvmetrics step
    (as under ``vllm serve`` on a GPU); at 2 ms on every 128th. The simulator's own steps
    take well under a millisecond here, so a wall clock would read far more rarely."""
    from benchmarks.added_cost_worker import KV, measure

    for step_ms, every in ((10.0, 32), (2.0, 128)):
        result = measure(2, 5 * 64, step_ms, seed=1)
        slots = result.kv_steps - result.recorded  # the steps after recorded ones
        assert result.cycles == 320 and slots == 320
        assert slots // every - 1 <= result.recorded <= slots // every + 1
        assert len(result.diffs["added"]) == BATCHES
    assert KV == 4


@pytest.mark.parametrize("argv, message", [
    (["--step-ms", "0"], "--step-ms: a decode step of 0.05 to 10,000 ms"),
    (["--step-ms", "nan"], "--step-ms"),
    (["--processes", "0"], "--processes: 1 to 64"),
    (["--cycles", "10"], "--cycles: 80 to 1,000,000"),
    (["--sizes", "0,16"], "--sizes"),
    (["--step-ms", "fast"], "--step-ms"),
])
def test_bad_options_get_one_line(argv: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.vllm_added_cost", *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and message in done.stderr
