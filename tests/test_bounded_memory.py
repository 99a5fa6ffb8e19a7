"""Memory stays bounded whatever the label values (issue 20, point 7): 100k distinct
label sets leave the page, the sink, Totals and the invariant checker within fixed
limits (RSS read from /proc, the page measured in bytes)."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import CounterIncrement, GaugeReadings, StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline

DISTINCT = 100_000
#: Fixed limits, far below what one entry per label set costs (the page was 9.7 MB and
#: Totals grew by 36 MB per 100k label sets before the caps).
MAX_PAGE_BYTES = 1_000_000
MAX_RSS_GROWTH_BYTES = 20 * 2**20


def _rss() -> int:
    gc.collect()
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def quiet() -> Iterator[None]:
    logging.disable(logging.CRITICAL)  # every refusal logs a line; not what is measured
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def test_100k_model_names_at_a_sink_keep_page_and_memory_bounded(quiet: None) -> None:
    sink = PrometheusSink(CollectorRegistry())
    readings = GaugeReadings(0.5, 1, 2, 0, 100)
    sink.inc(cat.PREEMPTIONS, ("warm-up", "0"), 1)  # first-use allocations out of the way
    before = _rss()
    for i in range(DISTINCT):
        common = (f"model-{i}", "0")
        sink.inc(cat.PREEMPTIONS, common, 1)
        sink.inc(cat.FINISHED_REQUESTS, (*common, "stopped"), 1)
        sink.set_gauges(common, readings)
    page = sink.render()
    growth = _rss() - before
    assert len(page) < MAX_PAGE_BYTES, len(page)
    assert growth < MAX_RSS_GROWTH_BYTES, growth
    overflow = [line for line in page.decode().splitlines()
                if line.startswith(cat.SERIES_OVERFLOW.name + "{")]
    assert len(overflow) <= (sink.max_engines + 1) * len(cat.SERIES_OVERFLOW.labels["metric"])


def test_100k_label_sets_through_a_pipeline_keep_totals_bounded(quiet: None) -> None:
    sink = PrometheusSink(CollectorRegistry())
    pipeline = MetricsPipeline([sink], model_name="m", engine="0")
    pipeline.record(StepEvents(0, [CounterIncrement(cat.PREEMPTIONS, 1)]))
    before = _rss()
    for i in range(DISTINCT):
        pipeline.record(StepEvents(i + 1, [
            CounterIncrement(cat.FINISHED_REQUESTS, 1, (f"reason-{i}",)),
            CounterIncrement(cat.PREFIX_CACHE_QUERY_TOKENS, 1, (f"src-{i}", "first")),
        ]))
    growth = _rss() - before
    catalogue_sets = sum(len(cat.bounded_label_sets(s)) for s in cat.COUNTERS)
    assert len(pipeline.totals.series()) <= catalogue_sets
    assert growth < MAX_RSS_GROWTH_BYTES, growth
    assert len(sink.render()) < MAX_PAGE_BYTES
    assert pipeline.totals.get(cat.GUARD_REJECTED_INCREMENTS) == 2 * DISTINCT
