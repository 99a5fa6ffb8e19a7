"""``kvmetrics_family_live``: the page says which families an engine computes.

The alert KVMetricsFamilyAbsent and the dashboard's "Families live" panel read it; a
family left off the page (an unusable vLLM hook) must read 0 there, never vanish
without a trace, and a family the engine never computes must have no series at all.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.pipeline import MetricsPipeline


def _live(sink: PrometheusSink) -> dict[str, float]:
    page = generate_latest(sink.registry).decode()
    return {sample.labels["family"]: sample.value
            for family in text_string_to_metric_families(page)
            if family.name == cat.FAMILY_LIVE.name
            for sample in family.samples}


def test_every_family_of_the_reference_engine_is_live() -> None:
    sink = PrometheusSink(CollectorRegistry())
    MetricsPipeline([sink], engine_kind="reference")
    assert _live(sink) == {s.name: 1.0 for s in cat.COMPUTED_FAMILIES}


def test_vllm_absent_families_read_zero_and_lab_only_ones_have_no_series() -> None:
    absent = {cat.ROLLED_BACK_TOKENS.name, cat.KV_CACHE_USAGE.name}
    sink = PrometheusSink(CollectorRegistry())
    MetricsPipeline([sink], engine_kind="vllm", absent=absent)
    live = _live(sink)
    lab_only = {s.name for s in cat.LAB_ONLY_FAMILIES}
    assert set(live) == {s.name for s in cat.COMPUTED_FAMILIES} - lab_only
    assert {name for name, value in live.items() if value == 0} == absent
    assert all(value == 1 for name, value in live.items() if name not in absent)


def test_a_family_that_goes_absent_while_running_reads_zero() -> None:
    sink = PrometheusSink(CollectorRegistry())
    pipeline = MetricsPipeline([sink], engine_kind="vllm")
    pipeline.mark_absent({cat.EVICTED_BLOCKS.name, cat.KV_VERIFIED_TOKENS.name})
    live = _live(sink)
    assert live[cat.EVICTED_BLOCKS.name] == 0
    assert cat.KV_VERIFIED_TOKENS.name not in live  # lab-only: never expected on vLLM
    assert sum(value == 0 for value in live.values()) == 1
