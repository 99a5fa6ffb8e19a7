"""Running totals of every accepted counter increment, by series.

The lab's summary, the invariant checks and the tests read these; because the
exporters receive exactly the increments added here, the scrape page, the OTLP
stream and the summary agree by construction (and the tests check that they do).
"""

from __future__ import annotations

import math
from collections import defaultdict

from kvmetrics.metrics.catalogue import MetricSpec


class Totals:
    def __init__(self) -> None:
        self._values: dict[tuple[str, tuple[str, ...]], float] = defaultdict(float)

    def add(self, spec: MetricSpec, label_values: tuple[str, ...],
            amount: float) -> float | None:
        """Add and return the series' new total; None (nothing added) if the total
        would no longer be a finite float.

        Bounded: the guard admits only the catalogue's label values, so there is at
        most one entry per label set of the catalogue (see ``cat.bounded_label_sets``).
        """
        key = (spec.name, label_values)
        total = self._values[key] + amount
        if not math.isfinite(total):
            return None
        self._values[key] = total
        return total

    def get(self, spec: MetricSpec, **labels: str) -> float:
        """Sum over every series of ``spec`` whose labels match the given ones."""
        own = (*spec.labels, *spec.open_labels)
        unknown = set(labels) - set(own)
        if unknown:
            raise KeyError(f"{spec.name} has no label {sorted(unknown)}")
        wanted = [(own.index(k), v) for k, v in labels.items()]
        total = 0.0
        for (name, values), amount in self._values.items():
            if name != spec.name:
                continue
            if all(values[idx] == v for idx, v in wanted):
                total += amount
        return total

    def drop(self, names: frozenset[str]) -> None:
        """Forget every series of these families (they left the page)."""
        for key in [k for k in self._values if k[0] in names]:
            del self._values[key]

    def series(self) -> dict[tuple[str, tuple[str, ...]], float]:
        return dict(self._values)

    def by_metric(self, spec: MetricSpec) -> dict[tuple[str, ...], float]:
        return {values: amount for (name, values), amount in self._values.items()
                if name == spec.name}
