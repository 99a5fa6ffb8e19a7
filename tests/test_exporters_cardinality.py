"""Label values stay bounded: catalogue sets only, a cap per family, overflow counted."""

from __future__ import annotations

import subprocess

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvmetrics.exporters.prometheus import OTHER_ENGINE, PrometheusSink
from kvmetrics.lab.config import LabConfig
from kvmetrics.lab.runner import load_items, run_lab
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline

pytestmark = pytest.mark.prometheus


def _page(sink: PrometheusSink) -> str:
    return sink.render().decode()


def test_a_label_value_outside_the_catalogue_is_refused_and_counted() -> None:
    sink = PrometheusSink(CollectorRegistry())
    pipeline = MetricsPipeline([sink], model_name="m", engine="0")
    events = StepEvents(step=1)
    events.finished("repetition", "req-1")  # not a catalogue finish reason
    events.finished("stopped", "req-2")
    pipeline.record(events)
    reg = sink.registry
    assert reg.get_sample_value(cat.FINISHED_REQUESTS.name, {
        "model_name": "m", "engine": "0", "reason": "repetition"}) is None
    assert reg.get_sample_value(cat.FINISHED_REQUESTS.name, {
        "model_name": "m", "engine": "0", "reason": "stopped"}) == 1
    # refused before any sink (so that the pipeline's own totals stay bounded too)
    assert reg.get_sample_value(cat.GUARD_REJECTED_INCREMENTS.name, {
        "model_name": "m", "engine": "0", "metric": cat.FINISHED_REQUESTS.name,
        "reason": "bad_labels"}) == 1
    assert pipeline.totals.by_metric(cat.FINISHED_REQUESTS) == {("stopped",): 1}
    check = subprocess.run(["promtool", "check", "metrics"], input=sink.render(),
                           capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_families_stop_growing_at_their_cap() -> None:
    sink = PrometheusSink(CollectorRegistry(), max_series_per_family=3)
    for engine in range(5):  # e.g. a bug that puts a request id into the engine label
        pipeline = MetricsPipeline([sink], engine=f"e{engine}")
        events = StepEvents(step=1)
        events.preempted(f"req-{engine}")
        pipeline.record(events)
    preemptions = [s for f in text_string_to_metric_families(_page(sink))
                   for s in f.samples if s.name == cat.PREEMPTIONS.name]
    assert sorted(s.labels["engine"] for s in preemptions) == ["e0", "e1", "e2"]
    # e3 and e4 got no series at all, so their drops count under the fixed catch-all
    overflow = sink.registry.get_sample_value(cat.SERIES_OVERFLOW.name, {
        "model_name": OTHER_ENGINE[0], "engine": OTHER_ENGINE[1],
        "metric": cat.PREEMPTIONS.name})
    assert overflow == 2


def test_no_request_id_ever_becomes_a_label_value() -> None:
    cfg = LabConfig(verify="off", fault_rate=0.2, abort_rate=0.2, progress=False,
                    max_requests=150, num_gpu_blocks=200)
    result = run_lab(cfg)
    ids = {item.request_id for item in load_items(cfg)}
    values = {v for family in text_string_to_metric_families(result.prometheus.render().decode())
              for sample in family.samples for v in sample.labels.values()}
    assert values and not values & ids
    assert result.summary["requests"]["aborted"] > 0
