"""The guard in front of every exporter: bad increments and broken invariants are refused,
counted and logged, exporter faults never reach the engine, strict mode raises."""

from __future__ import annotations

import logging
import math

import pytest

from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.lab.instrument import InstrumentedEngine
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.catalogue import MetricSpec
from kvmetrics.metrics.events import PoolSnapshot, StepEvents
from kvmetrics.metrics.guard import CounterViolationError
from kvmetrics.metrics.invariants import InvariantChecker
from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.engine import build_rig, make_request, tokens
from tests.helpers.metrics import sample
from tests.helpers.scenarios import preemption_before_first_output

REJECTED = cat.GUARD_REJECTED_INCREMENTS.name
INVARIANTS = cat.INVARIANT_VIOLATIONS.name


class SpySink:
    """Remembers every counter increment it receives."""

    def __init__(self) -> None:
        self.incs: list[tuple[str, tuple[str, ...], float]] = []

    def inc(self, spec: MetricSpec, label_values: tuple[str, ...], amount: float) -> None:
        if amount:
            self.incs.append((spec.name, label_values, amount))

    def set(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None:
        pass

    def observe(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None:
        pass

    def info(self, spec: MetricSpec, label_values: tuple[str, ...]) -> None:
        pass


class BrokenSink(SpySink):
    def inc(self, spec: MetricSpec, label_values: tuple[str, ...], amount: float) -> None:
        raise RuntimeError("exporter is broken")

    def set(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None:
        raise RuntimeError("exporter is broken")


def _events(step: int, *incs: tuple[MetricSpec, object, tuple[str, ...]]) -> StepEvents:
    events = StepEvents(step=step)
    for spec, amount, labels in incs:
        events.count(spec, amount, *labels, request_id="req-7")  # type: ignore[arg-type]
    return events


BAD_AMOUNTS = [(-5, "negative"), (float("nan"), "non_finite"), (float("inf"), "non_finite"),
               (float("-inf"), "non_finite"), (True, "not_a_number"), ("3", "not_a_number")]


@pytest.mark.parametrize(("amount", "kind"), BAD_AMOUNTS)
def test_bad_amount_is_refused_counted_and_logged(
    prometheus_sink: PrometheusSink, caplog: pytest.LogCaptureFixture, amount: object, kind: str,
) -> None:
    spy = SpySink()
    pipeline = MetricsPipeline([prometheus_sink, spy])
    with caplog.at_level(logging.ERROR, logger="kvmetrics.guard"):
        pipeline.record(_events(12, (cat.ROLLED_BACK_TOKENS, amount, ("sync", "fail")),
                                (cat.PREEMPTIONS, 2, ())))

    registry = prometheus_sink.registry
    assert sample(registry, REJECTED, reason=kind, metric=cat.ROLLED_BACK_TOKENS.name) == 1
    assert (sample(registry, "kvmetrics_rolled_back_tokens_total", mode="sync",
                   policy="fail") or 0) == 0
    assert pipeline.totals.get(cat.ROLLED_BACK_TOKENS) == 0
    # The rest of the step still counts.
    assert sample(registry, "kvmetrics_preemptions_total") == 2
    assert [i for i in spy.incs if i[0] == cat.ROLLED_BACK_TOKENS.name] == []
    (message,) = [r.getMessage() for r in caplog.records if r.name == "kvmetrics.guard"]
    assert "request=req-7" in message and "at step 12" in message
    assert cat.ROLLED_BACK_TOKENS.name in message


@pytest.mark.parametrize(("amount", "kind"), BAD_AMOUNTS)
def test_bad_amount_raises_in_strict_mode(amount: object, kind: str) -> None:
    pipeline = MetricsPipeline(strict=True)
    with pytest.raises(CounterViolationError) as info:
        pipeline.record(_events(3, (cat.PROMPT_TOKENS, amount, ("local_cache",))))
    assert info.value.violation.kind == kind
    assert info.value.violation.metric == cat.PROMPT_TOKENS.name
    assert info.value.violation.request_id == "req-7"
    assert pipeline.totals.get(cat.GUARD_REJECTED_INCREMENTS, reason=kind) == 1


def test_exporters_only_ever_see_finite_non_negative_amounts() -> None:
    spy = SpySink()
    pipeline = MetricsPipeline([spy])
    for step, (amount, _) in enumerate(BAD_AMOUNTS * 3, start=1):
        pipeline.record(_events(step, (cat.RECOMPUTED_TOKENS, amount, ("preemption",))))
    assert spy.incs
    assert all(isinstance(a, int | float) and not isinstance(a, bool) and math.isfinite(a)
               and a >= 0 for _, _, a in spy.incs)
    assert {name for name, _, _ in spy.incs} == {REJECTED}


def test_a_raising_exporter_is_logged_once_and_the_others_still_export(
    prometheus_sink: PrometheusSink, caplog: pytest.LogCaptureFixture,
) -> None:
    pipeline = MetricsPipeline([BrokenSink(), prometheus_sink], strict=True)
    with caplog.at_level(logging.ERROR, logger="kvmetrics.pipeline"):
        for step in range(1, 4):
            pipeline.record(_events(step, (cat.PREEMPTIONS, 1, ())))
    assert sample(prometheus_sink.registry, "kvmetrics_preemptions_total") == 3
    assert pipeline.totals.get(cat.PREEMPTIONS) == 3
    assert pipeline.violations == []  # an exporter fault is not an accounting violation
    failures = [r for r in caplog.records if "BrokenSink failed" in r.getMessage()]
    assert len(failures) == 1
    assert failures[0].exc_info is not None


def test_an_engine_keeps_running_with_a_raising_exporter() -> None:
    pipeline = MetricsPipeline([BrokenSink()])
    rig = build_rig(SchedulerConfig(block_size=16, num_gpu_blocks=16), pipeline=pipeline,
                    instrument=True, connector=False)
    rig.add(make_request("a", tokens(0, 40), 5), make_request("b", tokens(100, 20), 3))
    rig.run()
    assert pipeline.totals.get(cat.FINISHED_REQUESTS, reason="length") == 2


def test_the_wrapper_logs_and_continues_when_recording_itself_fails(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pipeline = MetricsPipeline()
    rig = build_rig(SchedulerConfig(block_size=16, num_gpu_blocks=16), pipeline=pipeline,
                    instrument=True, connector=False)

    def explode(events: StepEvents) -> None:
        raise KeyError("metrics bug")

    monkeypatch.setattr(pipeline, "record", explode)
    rig.add(make_request("a", tokens(0, 40), 3))
    with caplog.at_level(logging.ERROR, logger="kvmetrics.lab.instrument"):
        rig.run()
    assert rig.requests["a"].is_finished
    assert any("engine continues" in r.getMessage() for r in caplog.records)


def test_the_wrapper_lets_strict_violations_through() -> None:
    pipeline = MetricsPipeline(strict=True)
    rig = preemption_before_first_output("historical")
    rig.pipeline, rig.instrumented = pipeline, InstrumentedEngine(rig.scheduler, pipeline)
    with pytest.raises(CounterViolationError, match="request=x"):
        rig.run()


# -- invariants ---------------------------------------------------------------------


def _invariant_count(pipeline: MetricsPipeline, invariant: str) -> float:
    return pipeline.totals.get(cat.INVARIANT_VIOLATIONS, invariant=invariant)


def test_pool_accounting_break_is_an_invariant_violation(prometheus_sink: PrometheusSink) -> None:
    pipeline = MetricsPipeline([prometheus_sink])
    events = StepEvents(step=5)
    events.pool = PoolSnapshot(free_blocks=3, used_blocks=1, total_blocks=5,
                               negative_ref_counts=0)
    pipeline.record(events)
    assert sample(prometheus_sink.registry, INVARIANTS, invariant="pool_blocks_balance") == 1

    events = StepEvents(step=6)
    events.pool = PoolSnapshot(free_blocks=4, used_blocks=1, total_blocks=5,
                               negative_ref_counts=2)
    pipeline.record(events)
    assert _invariant_count(pipeline, "pool_blocks_balance") == 1
    assert _invariant_count(pipeline, "ref_counts_non_negative") == 1


def test_rollback_beyond_the_computed_tokens_is_an_invariant_violation(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pipeline = MetricsPipeline()
    events = StepEvents(step=9)
    events.rolled_back("sync", "recompute", "req-3", computed_before=16, computed_after=32)
    with caplog.at_level(logging.ERROR, logger="kvmetrics.guard"):
        pipeline.record(events)
    # The negative amount (-16) is refused, and the rollback itself breaks the invariant.
    assert pipeline.totals.get(cat.GUARD_REJECTED_INCREMENTS, reason="negative") == 1
    assert _invariant_count(pipeline, "rollback_within_computed") == 1
    assert any("request=req-3" in r.getMessage() and "invariant" in r.getMessage()
               for r in caplog.records)


def test_more_hits_than_queries_is_an_invariant_violation() -> None:
    pipeline = MetricsPipeline()
    events = StepEvents(step=1)
    events.prefix_lookup("external", "first", queried=16, hit=32, request_id="r")
    pipeline.record(events)
    assert _invariant_count(pipeline, "hits_within_queries") == 1
    with pytest.raises(CounterViolationError, match="external hits 32 exceed queries 16"):
        MetricsPipeline(strict=True).record(events)


def test_recompute_beyond_rollback_and_discarded_tokens_is_an_invariant_violation() -> None:
    pipeline = MetricsPipeline()
    events = StepEvents(step=1)
    events.rolled_back("sync", "recompute", "r", computed_before=48, computed_after=16)
    events.discarded_tokens = 16
    pipeline.record(events)
    events = StepEvents(step=2)
    events.recomputed("kv_load_failure", 48, "r")  # exactly 32 + 16: allowed
    pipeline.record(events)
    assert pipeline.violations == []
    events = StepEvents(step=3)
    events.recomputed("kv_load_failure", 1, "r")
    pipeline.record(events)
    assert _invariant_count(pipeline, "recompute_within_rollback") == 1


def test_a_decreasing_exported_total_is_an_invariant_violation() -> None:
    checker = InvariantChecker()
    checker.observe(cat.PREEMPTIONS, (), 3, 3)
    assert checker.check(StepEvents(step=1)) == []
    checker.observe(cat.PREEMPTIONS, (), 1, 2)  # an exporter total that went backwards
    (violation,) = checker.check(StepEvents(step=2))
    assert (violation.kind, violation.invariant, violation.metric) == (
        "invariant", "counters_monotonic", cat.PREEMPTIONS.name)
    assert checker.check(StepEvents(step=3)) == []  # reported once
