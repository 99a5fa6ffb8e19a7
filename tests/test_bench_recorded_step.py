"""``benchmarks.recorded_step_cost`` times the recorded steps of a real vLLM scheduler
and leaves its timing wrapper and kvmetrics' clock as they were."""

from __future__ import annotations

import pytest

from benchmarks import recorded_step_cost
from kvmetrics.vllm import step_end
from kvmetrics.vllm.scheduler import InstrumentedScheduler

pytestmark = pytest.mark.vllm


def test_the_periodic_reads_are_timed_and_everything_is_put_back() -> None:
    before = (InstrumentedScheduler._kv_end_step_timed, step_end.monotonic_ns)
    costs = recorded_step_cost.measure(8, 100, 10.0)
    # 100 steps at 10 ms: a periodic read every 32nd step, after the first steps' events.
    assert len(costs.recorded) >= 100 // step_end.GAUGE_EVERY
    assert all(ns > 0 for ns in costs.recorded)
    # The gauge read (self-checks inline) is timed inside each periodic read.
    assert len(costs.checks) == len(costs.recorded) and max(costs.checks) > 0
    assert (InstrumentedScheduler._kv_end_step_timed, step_end.monotonic_ns) == before
    assert "_kv_end_step_timed" not in InstrumentedScheduler.__dict__


def test_bad_arguments_stop_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        recorded_step_cost.main(["16", "--steps", "0"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--steps in 1..1499, --step-ms positive")
