"""The interface exporters implement, so the pipeline need not know any of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvmetrics.metrics.catalogue import MetricSpec
from kvmetrics.metrics.events import GaugeReadings


class MetricSink(Protocol):
    """Receives only guarded values; ``label_values`` include the common labels.

    A sink may also have ``drop_families(common, names)``: remove every series of these
    families for one engine (``common``) from its exposition. The pipeline asks
    ``hasattr`` (so it is no member here); a sink without it keeps their last values.
    """

    def inc(self, spec: MetricSpec, label_values: tuple[str, ...], amount: float) -> None: ...

    def set(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None: ...

    def observe(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None: ...

    def info(self, spec: MetricSpec, label_values: tuple[str, ...]) -> None: ...

    def set_gauges(self, common: tuple[str, ...], readings: GaugeReadings) -> None:
        """Optional: the end-of-step gauges at once (the pipeline falls back to ``set``)."""
        ...

    def bind_counter(self, spec: MetricSpec,
                     label_values: tuple[str, ...]) -> Callable[[float], None] | None:
        """Optional: a function that adds an amount to this counter series, as ``inc``
        would, valid until the family is dropped; None while the series has not been
        admitted (the pipeline keeps calling ``inc`` for it)."""
        ...

