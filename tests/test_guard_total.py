"""The guard is total (issue 20, point 6): any amount and any label tuple is either
accepted as a finite float or refused and counted with a reason; nothing raises, the
rest of the step still counts, and no exported total becomes +Inf."""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import CounterIncrement, StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline

REJECTED = cat.GUARD_REJECTED_INCREMENTS


def _pipeline() -> tuple[MetricsPipeline, PrometheusSink]:
    sink = PrometheusSink(CollectorRegistry())
    return MetricsPipeline([sink], model_name="m", engine="0"), sink


def _step(pipeline: MetricsPipeline, *incs: CounterIncrement, step: int = 1) -> None:
    # a good increment after the odd one: the rest of the step must still count
    pipeline.record(StepEvents(step, [*incs, CounterIncrement(cat.PREEMPTIONS, 1)]))


def _exported(sink: PrometheusSink, spec: cat.MetricSpec, **labels: str) -> float | None:
    return sink.registry.get_sample_value(spec.name, {"model_name": "m", "engine": "0",
                                                      **labels})


@pytest.mark.parametrize(("amount", "reason"), [
    (10**400, "overflow"), (-(10**400), "overflow"), (Decimal("2"), "not_a_number"),
    (None, "not_a_number"), ("5", "not_a_number"), (True, "not_a_number"),
    (np.bool_(True), "not_a_number"), (complex(1, 0), "not_a_number"),
    (float("nan"), "non_finite"), (np.float64("inf"), "non_finite"), (-1, "negative"),
])
def test_odd_amounts_are_refused_with_a_reason(amount: object, reason: str) -> None:
    pipeline, sink = _pipeline()
    _step(pipeline, CounterIncrement(cat.KV_VERIFIED_TOKENS, amount))  # type: ignore[arg-type]
    assert pipeline.totals.get(REJECTED, metric=cat.KV_VERIFIED_TOKENS.name, reason=reason) == 1
    assert pipeline.totals.get(cat.PREEMPTIONS) == 1
    assert (_exported(sink, cat.KV_VERIFIED_TOKENS) or 0) == 0


@pytest.mark.parametrize(("amount", "value"), [
    (np.int64(5), 5.0), (np.float32(2.0), 2.0), (np.uint8(7), 7.0), (Fraction(3, 2), 1.5),
    (2**62, float(2**62)), (-0.0, 0.0), (10**300, 1e300),
])
def test_real_numbers_of_any_type_are_accepted_as_floats(amount: object, value: float) -> None:
    pipeline, sink = _pipeline()
    _step(pipeline, CounterIncrement(cat.KV_VERIFIED_TOKENS, amount))  # type: ignore[arg-type]
    assert pipeline.totals.get(cat.KV_VERIFIED_TOKENS) == value
    assert _exported(sink, cat.KV_VERIFIED_TOKENS) == value
    assert pipeline.totals.get(REJECTED) == 0


def test_a_total_that_would_overflow_is_refused_not_exported_as_inf() -> None:
    pipeline, sink = _pipeline()
    _step(pipeline, CounterIncrement(cat.KV_VERIFIED_TOKENS, 1e308))
    _step(pipeline, CounterIncrement(cat.KV_VERIFIED_TOKENS, 1e308), step=2)
    assert _exported(sink, cat.KV_VERIFIED_TOKENS) == 1e308
    assert pipeline.totals.get(REJECTED, reason="overflow") == 1
    assert sink.render().count(b"+Inf") == sink.render().count(b'le="+Inf"')


@pytest.mark.parametrize("labels", [(), ("local",), ("local", "first", "x"), ("nope", "first"),
                                    (1, 2), "local"])
def test_wrong_label_tuples_are_refused_not_raised(labels: object) -> None:
    pipeline, _ = _pipeline()
    _step(pipeline, CounterIncrement(cat.PREFIX_CACHE_QUERY_TOKENS, 5,
                                     labels))  # type: ignore[arg-type]
    assert pipeline.totals.get(REJECTED, reason="bad_labels") == 1
    assert pipeline.totals.get(cat.PREEMPTIONS) == 1


_ANY_AMOUNT = st.one_of(
    st.integers(), st.integers(min_value=-(10**500), max_value=10**500), st.floats(),
    st.booleans(), st.none(), st.text(max_size=5), st.decimals(), st.fractions(),
    st.complex_numbers(), st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.floats(width=32).map(np.float32), st.floats().map(np.float64),
)
_LABEL_VALUE = st.one_of(st.sampled_from(["local", "external", "first", "preempted", ""]),
                         st.text(max_size=4), st.integers(), st.none())
_INCREMENT = st.builds(
    CounterIncrement, st.sampled_from(cat.EVENT_COUNTERS), _ANY_AMOUNT,
    st.one_of(st.tuples(), st.lists(_LABEL_VALUE, max_size=4).map(tuple)))


@settings(max_examples=300, deadline=None)
@given(st.lists(_INCREMENT, max_size=8))
def test_any_step_is_applied_without_raising_and_totals_stay_finite(
        incs: list[CounterIncrement]) -> None:
    pipeline, sink = _pipeline()
    for step in (1, 2):
        _step(pipeline, *incs, step=step)
    series = pipeline.totals.series()
    assert all(math.isfinite(v) and v >= 0 for v in series.values())
    # every increment is either counted in its series or refused with a reason
    accepted = sum(1 for (name, _), v in series.items() if name == cat.PREEMPTIONS.name
                   for _ in [v])
    assert accepted >= 1 and pipeline.totals.get(cat.PREEMPTIONS) >= 2
    refused = pipeline.totals.get(REJECTED)
    assert refused <= 2 * len(incs)
    for name, values in series:
        spec = cat.spec(name)
        assert len(values) == len(spec.labels)
        assert all(v in allowed for v, allowed in zip(values, spec.labels.values(),
                                                        strict=True))
    assert b"NaN" not in sink.render()
