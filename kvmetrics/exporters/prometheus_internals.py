"""The one module that uses prometheus-client's private names.

prometheus-client documents no way to do the three things below, so each reaches
into the library; nothing else in kvmetrics does. ``tests/test_prometheus_versions.py``
runs the exporter tests that exercise this module against the lowest and the highest
prometheus-client that pyproject.toml allows.

Private names used, and why:

- ``Counter._child_samples`` / ``Histogram._child_samples`` (overridden by
  :class:`CounterWithoutCreated` and :class:`HistogramWithoutCreated`): the samples of
  one series, so that its ``_created`` sample can be left out per metric. The public
  ``disable_created_metrics()`` is process-wide and would change vLLM's own page too.
- ``prometheus_client.values.MmapedDict`` (the module attribute the library reads when
  it opens a value file, replaced by :func:`reserve_multiprocess_space`) and
  ``MmapedDict._init_value``, ``._capacity``, ``._used``, ``._f`` (read and extended by
  :class:`ReservedMmapedDict`): where and how large the library grows a value file,
  so that its bytes are allocated before they are mapped (below).
- ``prometheus_client.values.ValueClass``, ``MutexValue`` and ``MultiProcessValue``
  (:func:`switch_to_multiprocess_values`): the value class is chosen once, at import, from
  ``PROMETHEUS_MULTIPROC_DIR``; in a vLLM EngineCore that import happened long before
  kvmetrics runs.

Multiprocess files whose space is reserved before it is written: ENOSPC, not SIGBUS.

prometheus-client keeps a process's values in ``*.db`` files it maps into memory. It
makes a file (and later doubles it) with ``truncate``, which allocates nothing, then
writes through the mapping. On a full filesystem (a small tmpfs is the usual
``PROMETHEUS_MULTIPROC_DIR``) the first write to a page with no block behind it is a
SIGBUS: the process dies with exit 135 and no message, and inside vLLM that process is
the EngineCore.

:class:`ReservedMmapedDict` allocates every byte with ``posix_fallocate`` before the
library maps it, so a full filesystem is an ``OSError`` at the moment a file is made
or grown (when a new series is created), which the exporter catches: the new series
is dropped and counted, the ones that already have their place keep counting.

The files are per process and shared by every metric of that process (vLLM's own
too), so the reservation has to happen where the library creates them:
:func:`reserve_multiprocess_space` points prometheus-client's file class at this
subclass, once. It changes nothing else: same format, same names, same growth.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

from prometheus_client import Counter, Histogram, values
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.samples import Sample

#: The size prometheus-client gives a new file (``mmap_dict._INITIAL_MMAP_SIZE``).
_INITIAL_SIZE = 1 << 16


def _entry_size(key: str) -> int:
    """Bytes one new value takes in a file: a 4-byte length, the key padded so that
    the two doubles after it are 8-byte aligned, and those two doubles."""
    n = len(key.encode("utf-8"))
    return 4 + n + (8 - (n + 4) % 8) + 16


def _reserve(fd: int, start: int, end: int) -> None:
    """Allocate bytes [start, end) of ``fd`` or raise OSError leaving its size as it was."""
    if end <= start:
        return
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError:
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_size != start:
                os.ftruncate(fd, start)  # a partial allocation must not look like room
        raise


class ReservedMmapedDict(MmapedDict):
    """prometheus-client's value file, with its space allocated before it is mapped."""

    def __init__(self, filename: str, read_mode: bool = False) -> None:
        if not read_mode:
            _reserve_file(filename)
        super().__init__(filename, read_mode)

    def _init_value(self, key: str) -> None:
        capacity = self._capacity
        while self._used + _entry_size(key) > capacity:
            capacity *= 2
        if capacity > self._capacity:
            _reserve(self._f.fileno(), self._capacity, capacity)
        super()._init_value(key)


def _reserve_file(filename: str) -> None:
    """Give ``filename`` (new, or left by an earlier process with our pid) real blocks
    for its whole mapped size. A file this call made and could not fill is removed: an
    empty ``*.db`` left behind would fail every scrape of prometheus-client's own
    collector (vLLM's ``/metrics``)."""
    fd = os.open(filename, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            _reserve(fd, 0, max(size, _INITIAL_SIZE))
        except OSError:
            if size == 0:
                with contextlib.suppress(OSError):
                    os.unlink(filename)
            raise
    finally:
        os.close(fd)


def reserve_multiprocess_space() -> None:
    """Make every value file this process creates from now on a :class:`ReservedMmapedDict`.

    Files opened before (by metrics created earlier in the process) keep the library's
    class; the exporter calls this before it creates any metric.
    """
    # attr-defined: the library imports the class into ``values`` without exporting it.
    if values.MmapedDict is MmapedDict:  # type: ignore[attr-defined]  # private, see above
        values.MmapedDict = ReservedMmapedDict  # type: ignore[attr-defined]  # private


def switch_to_multiprocess_values() -> None:
    """Make every value this process's prometheus-client creates from now on go to the
    files of ``PROMETHEUS_MULTIPROC_DIR`` (set it first): the library picked its value
    class when it was first imported. Values made earlier stay in memory."""
    if values.ValueClass is values.MutexValue:
        values.ValueClass = values.MultiProcessValue()


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
