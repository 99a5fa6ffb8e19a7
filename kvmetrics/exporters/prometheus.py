"""Prometheus exposition of the catalogue through prometheus-client.

Each engine gets its own :class:`CollectorRegistry` (never the global one, so
that a host process such as vLLM keeps its own metrics apart). In multiprocess
mode the values live in ``PROMETHEUS_MULTIPROC_DIR`` and any process can serve
the sum of all of them.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvmetrics.exporters.http import HTTPEndpoint, ServerLimits, start_endpoint
from kvmetrics.exporters.mmap_space import reserve_multiprocess_space
from kvmetrics.exporters.multiprocess import ProcessLifetime, TolerantMultiProcessCollector
from kvmetrics.exporters.prometheus_internals import CounterWithoutCreated, HistogramWithoutCreated
from kvmetrics.exporters.tls import TLSConfigError as TLSConfigError  # re-exported
from kvmetrics.exporters.tls import TLSOptions, tls_context
from kvmetrics.exporters.value_watcher import on_rewrite
from kvmetrics.metrics.catalogue import (
    ALL_METRICS,
    KV_CACHE_BLOCKS,
    KV_CACHE_USAGE,
    REQUESTS,
    SCRAPE_ERRORS,
    SERIES_OVERFLOW,
    MetricSpec,
)
from kvmetrics.metrics.events import GaugeReadings
from kvmetrics.metrics.logs import get_logger

log = get_logger("kvmetrics.prometheus")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9400

#: How gauges of several processes combine in multiprocess mode. Each is the state of
#: one engine, written by the one live process that runs it (its own ``engine``
#: label): the value is that process's latest write, and it goes with the process.
#: (livesum would add a restarted engine's values to those of a process that is gone
#: but not yet reaped, or of a second process misconfigured with the same label.)
_MULTIPROC_GAUGE_MODE: dict[str, Literal["livemostrecent"]] = {
    KV_CACHE_USAGE.name: "livemostrecent",
    KV_CACHE_BLOCKS.name: "livemostrecent",
    REQUESTS.name: "livemostrecent",
    "kvmetrics_build_info": "livemostrecent"}


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def metric_for(spec: MetricSpec,
               registry: CollectorRegistry | None) -> Counter | Gauge | Histogram:
    """prometheus-client's metric for a catalogue family, as every kvmetrics page serves
    it (no ``_created`` samples; a gauge's multiprocess mode by family)."""
    labels = spec.label_names
    if spec.kind == "counter":
        return CounterWithoutCreated(spec.base_name, spec.help, labels, registry=registry)
    if spec.kind == "histogram":
        return HistogramWithoutCreated(spec.name, spec.help, labels, registry=registry,
                                       buckets=spec.buckets)
    mode = _MULTIPROC_GAUGE_MODE.get(spec.name, "livemostrecent")
    return Gauge(spec.name, spec.help, labels, registry=registry, multiprocess_mode=mode)


#: Label sets one family may grow to before new ones are dropped (and counted).
#: Every catalogue label but model_name/engine is enumerable (about 50 sets per
#: engine at most), so this only bites on a runaway model_name or engine value.
DEFAULT_MAX_SERIES_PER_FAMILY = 4096
#: (model_name, engine) label sets one sink serves; a process normally has one engine
#: per sink, the lab a handful. Updates of engines beyond this are dropped and counted
#: under :data:`OTHER_ENGINE`, so the overflow family too has a fixed number of series.
DEFAULT_MAX_ENGINES = 32
#: The (model_name, engine) values overflow is counted under for engines past the cap.
OTHER_ENGINE = ("_other", "_other")


#: One labelled series: a Counter's, Gauge's or Histogram's child, as its spec's kind says
#: (the callers call only what that kind has: inc, set or observe).
_Series = Any


#: The scrape-error reason of each event the value-file watcher reports (any other
#: event is a repair: multiprocess_file_rewritten).
_FILE_EVENT_REASONS = {"unwritable": "multiprocess_file_unwritable",
                       "rewrite_failed": "multiprocess_rewrite_failed",
                       "series_unstored": "multiprocess_series_unstored"}


class PrometheusSink:
    """Implements :class:`kvmetrics.metrics.sink.MetricSink` with prometheus-client.

    A new series is admitted only if its label values are in the catalogue's sets
    and its family is under ``max_series_per_family``; otherwise the update is
    dropped and counted in ``kvmetrics_series_overflow_total{metric}``, so a bad
    label can never grow the scrape page (or Prometheus) without bound.
    """

    def __init__(self, registry: CollectorRegistry | None = None,
                 max_series_per_family: int = DEFAULT_MAX_SERIES_PER_FAMILY,
                 max_engines: int = DEFAULT_MAX_ENGINES) -> None:
        directory = multiprocess_dir()
        self.multiprocess = directory is not None
        if directory is not None:
            reserve_multiprocess_space()  # before any value file is made: ENOSPC, not SIGBUS
            on_rewrite(self._rewrote_files)
        #: Updates dropped because their new series could not be stored (multiprocess
        #: mode: no space, or the directory gone). Logged once, then on close().
        self.unstored_updates = 0
        self._storage_error: str | None = None
        self._merged: tuple[str, CollectorRegistry] | None = None
        #: Marks this process dead in the shared directory on close() and at exit.
        self._lifetime = ProcessLifetime(directory) if directory else None
        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
        self.registry = registry
        target = None if self.multiprocess else registry
        # The per-step gauges are read at scrape time from the last readings, so a
        # step costs one dict store instead of four locked gauge updates. In
        # multiprocess mode the values must reach the shared files: set eagerly.
        self._step_gauges = None if self.multiprocess else _StepGauges()
        self._metrics: dict[str, Counter | Gauge | Histogram] = {}
        for spec in ALL_METRICS:
            if self._step_gauges is not None and spec in _STEP_GAUGES:
                continue
            self._metrics[spec.name] = metric_for(spec, target)
        if self._step_gauges is not None:
            registry.register(self._step_gauges)
        self._children: dict[tuple[str, tuple[str, ...]], _Series] = {}
        self._series: dict[str, int] = {}
        #: (model_name, engine) label sets with at least one admitted series.
        self._engines: set[tuple[str, ...]] = set()
        self.max_series_per_family = max_series_per_family
        self.max_engines = max_engines

    def _child(self, spec: MetricSpec, values: tuple[str, ...],
               count: bool = True) -> _Series | None:
        key = (spec.name, values)
        child = self._children.get(key)
        if child is None:
            if self._storage_error is not None:
                self.unstored_updates += 1
                return None
            if not self._admit(spec, values, count):
                return None
            try:
                child = self._metrics[spec.name].labels(*values)
            except OSError as e:  # multiprocess mode: the value file cannot grow
                if spec is not SERIES_OVERFLOW:  # its _admit counts no series
                    self._series[spec.name] -= 1
                self._storage_failed(e)
                return None
            self._children[key] = child
        return child

    def _storage_failed(self, e: OSError) -> None:
        """No new series from now on in this process (each would fail the same way, at
        the cost of a system call); the existing ones keep their reserved place."""
        self.unstored_updates += 1
        atexit.register(self._report_unstored)  # an engine may exit without close()
        self._storage_error = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        log.error("kvmetrics: cannot store new metric series in PROMETHEUS_MULTIPROC_DIR "
                  "%r (%s); new series are dropped from now on in pid %d, existing ones "
                  "keep counting", multiprocess_dir(), self._storage_error, os.getpid())

    def _admit(self, spec: MetricSpec, values: tuple[str, ...], count: bool) -> bool:
        """First sight of a label set: bounded values and room left in the family.

        ``count=False`` for the zero-valued series created up front: refusing those
        drops nothing a user would miss, so it is not counted as overflow. At most
        ``max_engines`` (model_name, engine) sets are served; the overflow counter has
        one series per served engine and family, plus one per family under
        :data:`OTHER_ENGINE` for everything else: a fixed number, whatever the labels.
        """
        common = len(values) - len(spec.labels) - len(spec.open_labels)
        engine, own = values[:common], values[common:]
        if spec is SERIES_OVERFLOW:
            return (engine in self._engines or engine == OTHER_ENGINE) and \
                own[0] in spec.labels["metric"]
        known_values = all(v in allowed for v, allowed in zip(own, spec.labels.values(),
                                                               strict=False))
        room_for_engine = engine in self._engines or len(self._engines) < self.max_engines
        ok = known_values and room_for_engine and \
            self._series.get(spec.name, 0) < self.max_series_per_family
        if ok:
            self._engines.add(engine)
            self._series[spec.name] = self._series.get(spec.name, 0) + 1
            return True
        if count:
            self._count_overflow(engine, spec.name)
        return False

    def _count_overflow(self, engine: tuple[str, ...], family: str) -> None:
        where = engine if engine in self._engines else OTHER_ENGINE
        overflow = self._child(SERIES_OVERFLOW, where + (family,))
        if overflow is not None:
            overflow.inc()

    def inc(self, spec: MetricSpec, label_values: tuple[str, ...], amount: float) -> None:
        child = self._child(spec, label_values, count=amount != 0)
        if child is not None:
            child.inc(amount)

    def bind_counter(self, spec: MetricSpec,
                     label_values: tuple[str, ...]) -> Callable[[float], None] | None:
        """The series' own ``inc`` once it exists (its label lookup done once)."""
        child = self._children.get((spec.name, label_values))
        if child is None:
            return None
        inc: Callable[[float], None] = child.inc
        return inc

    def set(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None:
        child = self._child(spec, label_values)
        if child is not None:
            child.set(value)

    def set_gauges(self, common: tuple[str, ...], readings: GaugeReadings) -> None:
        """The end-of-step gauges of one engine (``common``: model_name, engine)."""
        gauges = self._step_gauges
        if gauges is not None and common in gauges.latest:
            gauges.latest[common] = readings  # an engine admitted before: one store
            return
        if gauges is None:
            for spec, values, value in readings.samples():
                self.set(spec, common + values, value)
            return
        if common not in gauges.latest and (
                len(gauges.latest) >= self.max_series_per_family
                or (common not in self._engines and len(self._engines) >= self.max_engines)):
            self._count_overflow(common, KV_CACHE_USAGE.name)
            return
        self._engines.add(common)
        gauges.latest[common] = readings

    def observe(self, spec: MetricSpec, label_values: tuple[str, ...], value: float) -> None:
        child = self._child(spec, label_values)
        if child is not None:
            child.observe(value)

    def info(self, spec: MetricSpec, label_values: tuple[str, ...]) -> None:
        child = self._child(spec, label_values)
        if child is not None:
            child.set(1)

    def drop_families(self, common: tuple[str, ...], names: frozenset[str]) -> None:
        """Remove one engine's series of these families from the page (the family's
        HELP and TYPE stay, with no sample: as a family that never counted)."""
        for key in [k for k in self._children if k[0] in names and k[1][:len(common)] == common]:
            del self._children[key]
            if key[0] in self._series:  # (the overflow family counts no series)
                self._series[key[0]] -= 1
            metric = self._metrics.get(key[0])
            if metric is not None:
                metric.remove(*key[1])
        gauges = self._step_gauges
        if gauges is not None and names & _STEP_GAUGE_NAMES:
            gauges.hidden[common] = gauges.hidden.get(common, frozenset()) | names

    def serving_registry(self) -> CollectorRegistry:
        """The registry a scrape should read: this sink's series (or, in multiprocess
        mode, every process's, which have no ``_created`` samples either)."""
        directory = multiprocess_dir()
        if self.multiprocess and directory:
            if self._merged is None or self._merged[0] != directory:
                # One collector per sink: it keeps what it read of files that do not change.
                source = CollectorRegistry(auto_describe=False)
                source.register(TolerantMultiProcessCollector(
                    directory, self._bad_file, on_over_budget=self._over_budget_file))
                self._merged = (directory, source)
            return self._merged[1]
        return self.registry

    def _bad_file(self, path: str) -> None:
        """Count a multiprocess file left out of a page (under this sink's first engine)."""
        self._count_file_problem("unreadable_multiprocess_file")

    def _over_budget_file(self, path: str) -> None:
        self._count_file_problem("multiprocess_file_over_budget")

    def _rewrote_files(self, what: str, where: str) -> None:
        """Something happened to this process's value files (watcher thread): a
        repair, a failed one, or a new series kept in memory only."""
        self._count_file_problem(_FILE_EVENT_REASONS.get(what, "multiprocess_file_rewritten"))

    def _count_file_problem(self, reason: str) -> None:
        engine = min(self._engines) if self._engines else OTHER_ENGINE
        child = self._child(SCRAPE_ERRORS, engine + (reason,))
        if child is not None:
            child.inc()

    def _report_unstored(self) -> None:
        """How many updates the storage failure cost, said once (on close or at exit)."""
        if self._storage_error is not None and self.unstored_updates:
            log.error("kvmetrics: %d metric updates were dropped in pid %d: no room for "
                      "their series in PROMETHEUS_MULTIPROC_DIR (%s)", self.unstored_updates,
                      os.getpid(), self._storage_error)
            self.unstored_updates = 0

    def close(self) -> None:
        """The engine stops: in multiprocess mode its live gauges go with it."""
        self._report_unstored()
        if self._lifetime is not None:
            self._lifetime.close()

    def render(self) -> bytes:
        return generate_latest(self.serving_registry())


_STEP_GAUGES = (KV_CACHE_USAGE, KV_CACHE_BLOCKS, REQUESTS)
_STEP_GAUGE_NAMES = frozenset(spec.name for spec in _STEP_GAUGES)


class _StepGauges(Collector):
    """Exposes each engine's last GaugeReadings when Prometheus scrapes."""

    def __init__(self) -> None:
        self.latest: dict[tuple[str, ...], GaugeReadings] = {}
        #: Per engine, the gauge families taken off its page (drop_families).
        self.hidden: dict[tuple[str, ...], frozenset[str]] = {}

    def _families(self) -> dict[str, GaugeMetricFamily]:
        return {spec.name: GaugeMetricFamily(spec.name, spec.help, labels=spec.label_names)
                for spec in _STEP_GAUGES}

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families().values()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = self._families()
        for common, g in dict(self.latest).items():  # a copy: steps go on meanwhile
            hidden = self.hidden.get(common, ())
            for spec, values, value in g.samples():
                if spec.name not in hidden:
                    families[spec.name].add_metric([*common, *values], value)
        yield from families.values()


@dataclass
class MetricsServer:
    endpoint: HTTPEndpoint
    #: Set once the endpoint has served a page.
    scraped: threading.Event = field(default_factory=threading.Event)
    tls: bool = False

    @property
    def url(self) -> str:
        """Where to scrape it, as a person would paste it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/metrics"

    @property
    def port(self) -> int:
        return self.endpoint.port

    @property
    def host(self) -> str:
        return self.endpoint.host

    def wait_for_scrape(self, timeout: float) -> bool:
        """Block until the endpoint has served a page; False after ``timeout`` seconds."""
        return self.scraped.wait(timeout)

    def refresh(self) -> None:
        """Serve the current values from the next scrape on, not a page cached up to
        ``page_max_age_s`` ago (a run that finished shows its final totals at once)."""
        self.endpoint.refresh()

    def stop(self) -> None:
        self.endpoint.stop()


def serve(
    registry: CollectorRegistry,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    tls: TLSOptions | None = None,
    limits: ServerLimits | None = None,
) -> MetricsServer:
    """Serve ``registry`` (a sink's :meth:`PrometheusSink.serving_registry`) as
    ``/metrics`` on ``host:port`` (loopback unless told otherwise; port 0 picks one).

    TLSConfigError (one line) for TLS files that cannot be used; OSError for a busy port.
    """
    context = tls_context(tls) if tls is not None and tls.enabled else None
    scraped = threading.Event()
    endpoint = start_endpoint(registry, host, port, tls=context,
                              limits=limits, on_page=scraped.set)
    return MetricsServer(endpoint, scraped, tls=context is not None)


def parse_host_port(text: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (``[::1]:PORT`` for IPv6); raises ValueError naming the problem."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range in {text!r}")
    host = host.strip("[]") or DEFAULT_HOST
    return host, port
