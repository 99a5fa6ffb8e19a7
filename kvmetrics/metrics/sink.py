"""The interface exporters implement, so the pipeline need not know any of them."""

from __future__ import annotations

from typing import Protocol

from kvmetrics.metrics.catalogue import MetricSpec
from kvmetrics.metrics.events import GaugeReadings


class MetricSink(Protocol):
    """Receives only guarded values; ``label_values`` include the common labels."""

    def inc(self, spec: MetricSpec, label_values: tuple[str, ...], amount: float) -> None: ...

    def set(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None: ...

    def observe(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None: ...

    def info(self, spec: MetricSpec, label_values: tuple[str, ...]) -> None: ...

    def set_gauges(self, common: tuple[str, ...], readings: GaugeReadings) -> None:
        """Optional: the end-of-step gauges at once (the pipeline falls back to ``set``)."""
        ...

    def drop_families(self, common: tuple[str, ...], names: frozenset[str]) -> None:
        """Optional: remove every series of these families for one engine (``common``)
        from the exposition; a sink without it keeps their last values."""
        ...
