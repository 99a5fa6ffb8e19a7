"""Reading exported values back: Prometheus registries, scrape pages and OTel data."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.pipeline import MetricsPipeline

Series = dict[tuple[str, tuple[str, ...]], float]
COMMON = {"model_name": "default", "engine": "0"}


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    """One sample of an engine with the default common labels (None if absent)."""
    return registry.get_sample_value(name, {**COMMON, **labels})


def event_totals(pipeline: MetricsPipeline) -> Series:
    """The pipeline's running totals without kvmetrics' own CPU time: that counter
    measures what observing cost this process, not an event of the engine, so two
    engines (or two runs) that did the same thing differ in it."""
    return {key: value for key, value in pipeline.totals.series().items()
            if key[0] != cat.INSTRUMENTATION_CPU.name}


def pipeline_counters(pipeline: MetricsPipeline) -> Series:
    """The pipeline's running totals, keyed like :func:`counters_from_page`."""
    return {key: value for key, value in pipeline.totals.series().items() if value}


def _counter_key(spec: cat.MetricSpec, labels: dict[str, str]) -> tuple[str, ...]:
    return tuple(labels[name] for name in (*spec.labels, *spec.open_labels))


def counters_from_page(text: str, engine: str | None = None) -> Series:
    """Catalogue counters on a text scrape page, summed over the common labels.

    With ``engine`` only that engine's series count.
    """
    by_base = {spec.base_name: spec for spec in cat.COUNTERS}
    out: Series = defaultdict(float)
    for family in text_string_to_metric_families(text):
        spec = by_base.get(family.name)
        if spec is None or family.type != "counter":
            continue
        for s in family.samples:
            if s.name != spec.name or (engine is not None and s.labels["engine"] != engine):
                continue
            out[(spec.name, _counter_key(spec, s.labels))] += s.value
    return {key: value for key, value in out.items() if value}


def counters_from_points(points: Iterable[tuple[str, dict[str, str], float]]) -> Series:
    """Sum OTel-style points (instrument name, attributes, value) into catalogue series."""
    by_base = {spec.base_name: spec for spec in cat.COUNTERS}
    out: Series = defaultdict(float)
    for name, attrs, value in points:
        spec = by_base.get(name)
        if spec is not None:
            out[(spec.name, _counter_key(spec, attrs))] += value
    return {key: value for key, value in out.items() if value}


def counters_from_query(results: dict[str, list[dict]]) -> Series:
    """Series from ``sum by (labels) (name)`` query results, keyed by metric name."""
    out: Series = {}
    for name, vector in results.items():
        spec = cat.spec(name)
        for item in vector:
            value = float(item["value"][1])
            if value:
                out[(name, _counter_key(spec, item["metric"]))] = value
    return out
