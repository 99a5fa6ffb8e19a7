"""prometheus-client's private names that the exporter uses, outside the value files.

prometheus-client documents no way to do the two things below, so each reaches into
the library. The third private use, the library's value-file class replaced by one that
reserves its space (``values.MmapedDict``), is :mod:`kvmetrics.exporters.mmap_space`'s
whole job and lives there. ``tests/test_prometheus_versions.py`` runs the exporter tests
that exercise both modules with the lowest prometheus-client pyproject.toml allows.

Private names used here, and why:

- ``Counter._child_samples`` / ``Histogram._child_samples`` (overridden by
  :class:`CounterWithoutCreated` and :class:`HistogramWithoutCreated`): the samples of
  one series, so that its ``_created`` sample can be left out per metric. The public
  ``disable_created_metrics()`` is process-wide and would change vLLM's own page too.
- ``prometheus_client.values.ValueClass``, ``MutexValue`` and ``MultiProcessValue``
  (:func:`switch_to_multiprocess_values` and its undoing): the value class is chosen
  once, at import, from ``PROMETHEUS_MULTIPROC_DIR``; in a vLLM EngineCore that import
  happened long before kvmetrics runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Histogram, values
from prometheus_client.samples import Sample


def switch_to_multiprocess_values() -> None:
    """Make every value this process's prometheus-client creates from now on go to the
    files of ``PROMETHEUS_MULTIPROC_DIR`` (set it first): the library picked its value
    class when it was first imported. Values made earlier stay in memory."""
    if values.ValueClass is values.MutexValue:
        values.ValueClass = values.MultiProcessValue()


def values_in_memory() -> bool:
    """Whether this process's prometheus-client keeps new values in memory (no files)."""
    return values.ValueClass is values.MutexValue


def switch_to_memory_values() -> None:
    """Undo :func:`switch_to_multiprocess_values`: values made from now on are kept in
    memory again (those made meanwhile keep their files)."""
    values.ValueClass = values.MutexValue


class CounterWithoutCreated(Counter):
    """A Counter whose series have no ``_created`` sample.

    prometheus-client adds a ``<counter>_created`` sample per series; it doubles the
    page for nothing a kvmetrics dashboard or rule reads. It is left out here, per
    metric, rather than with ``disable_created_metrics()``, which would also change
    the pages of the host process's own metrics (vLLM's), and rather than by
    filtering the rendered families (a copy of every family on every scrape).
    """

    def _child_samples(self) -> Iterable[Sample]:
        samples = tuple(super()._child_samples())
        return samples[:1]  # _total (then _created, when enabled)


class HistogramWithoutCreated(Histogram):
    """A Histogram whose series have no ``_created`` sample (see
    :class:`CounterWithoutCreated`)."""

    def _child_samples(self) -> Iterable[Sample]:
        samples = tuple(super()._child_samples())
        return samples[:-1] if samples and samples[-1].name == "_created" else samples
