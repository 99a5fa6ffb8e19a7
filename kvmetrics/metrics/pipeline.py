"""From step events to guarded totals and exporters.

One pipeline per engine instance: it owns the guard, the invariant checker, the
running totals and the list of sinks (Prometheus, OpenTelemetry, ...). Nothing
here may raise into the engine loop except a :class:`CounterViolationError` in
strict mode, which is what strict mode is for.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from kvmetrics import __version__
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import GaugeReadings, StepEvents
from kvmetrics.metrics.guard import Violation, guard_increment, report
from kvmetrics.metrics.invariants import InvariantChecker
from kvmetrics.metrics.logs import get_logger
from kvmetrics.metrics.sink import MetricSink
from kvmetrics.metrics.totals import Totals

log = get_logger("kvmetrics.pipeline")


#: Violations kept for reports; a long broken run keeps counting but stops keeping them.
MAX_KEPT_VIOLATIONS = 1000
_EVENT_COUNTER_NAMES = frozenset(s.name for s in cat.EVENT_COUNTERS)


class MetricsPipeline:
    def __init__(
        self,
        sinks: Sequence[MetricSink] = (),
        *,
        model_name: str = "default",
        engine: str = "0",
        engine_kind: str = "reference",
        recovery: str = "vllm",
        vllm: tuple[str, str, str] = ("", "", ""),
        strict: bool = False,
        check_invariants: bool = True,
        absent: Collection[str] = (),
    ) -> None:
        self.sinks = list(sinks)
        #: Families the engine cannot compute (e.g. an unusable vLLM hook): never
        #: created, never updated, so the page shows no series rather than a false 0.
        self.absent = frozenset(absent)
        self.common = (model_name, engine)
        self.engine_kind = engine_kind
        #: Whose recovery path the engine runs (build info), so that a fleet can tell
        #: replicas that change vLLM's decisions (evict) from those that only observe.
        self.recovery = recovery
        #: On vLLM: its version, "true"/"false" (verified), the fingerprints that differ.
        self.vllm = vllm
        self.strict = strict
        self.totals = Totals()
        #: The first MAX_KEPT_VIOLATIONS violations, in order (all are counted).
        self.violations: list[Violation] = []
        self._invariants = InvariantChecker() if check_invariants else None
        self._failed_sinks: set[tuple[int, type]] = set()
        #: Per counter series (family name, own label values): each sink's bound adder
        #: (``bind_counter``), so that an increment skips the sinks' label lookups. A
        #: series is here only once every sink bound it; entries of families that leave
        #: the page go with them, and a sink added late empties it.
        self._bound: dict[tuple[str, tuple[str, ...]],
                          tuple[tuple[MetricSink, Callable[[float], None]], ...]] = {}
        self._last_gauges: GaugeReadings | None = None
        self._announce()

    def add_sink(self, sink: MetricSink) -> None:
        """Attach an exporter late; it sees the build info and the totals so far."""
        self.sinks.append(sink)
        self._bound.clear()
        self._announce_to(sink)
        for (name, values), amount in self.totals.series().items():
            self._safely(sink, "inc", cat.spec(name), self.common + values, amount)

    def record(self, events: StepEvents) -> None:
        """Apply one step's events. Safe to call from inside an engine loop."""
        increments = events.increments
        if not increments and events.pool is None and events.recovery_seconds is None \
                and not events.rollbacks and not events.discarded_tokens:
            # Only gauges (an engine's periodic read): nothing for the invariants, which
            # look at increments, the pool, rollbacks and discarded tokens.
            self._publish_gauges(events.gauges)
            return
        step = events.step
        for inc in increments:
            amount, violation = guard_increment(inc, step)
            if violation is None:
                violation = self._apply(inc.spec, inc.label_values, amount, step,
                                        inc.request_id)
            if violation is not None:
                self._violate(violation)
        self._publish_gauges(events.gauges)
        if events.recovery_seconds is not None and cat.RECOVERY_DURATION.name not in self.absent:
            for sink in self.sinks:
                self._safely(sink, "observe", cat.RECOVERY_DURATION, self.common,
                             events.recovery_seconds)
        if self._invariants is not None:
            for violation in self._invariants.check(events):
                self._violate(violation)

    # -- internals --------------------------------------------------------------

    def _publish_gauges(self, g: GaugeReadings | None) -> None:
        if g is None or g == self._last_gauges:
            # Decode-heavy steps rarely change these; skipping equal readings keeps
            # the per-step cost of instrumentation near zero.
            return
        self._last_gauges = g
        for sink in self.sinks:
            try:  # (even looking the method up may raise, in a broken sink)
                publish = getattr(sink, "set_gauges", None)
                if publish is not None:
                    publish(self.common, g)
                    continue
            except Exception:  # an exporter bug must never stop the engine
                self._sink_failed(sink, "set_gauges")
                continue
            self._set_each(sink, g)

    def _announce(self) -> None:
        for sink in self.sinks:
            self._announce_to(sink)

    def _announce_to(self, sink: MetricSink) -> None:
        """Build info, and every bounded counter series at zero (see bounded_label_sets)."""
        self._safely(sink, "info", cat.BUILD_INFO, self.common + (__version__, self.engine_kind,
                                                         self.recovery, *self.vllm))
        for spec in cat.COUNTERS:
            if spec.name in self.absent:
                continue
            for values in cat.bounded_label_sets(spec):
                self._safely(sink, "inc", spec, self.common + values, 0)
        self._set_family_live(sink, cat.expected_families(self.engine_kind))

    def _set_family_live(self, sink: MetricSink, families: Collection[str]) -> None:
        """``kvmetrics_family_live``: 1 for each family computed, 0 for one left absent,
        so that a rule can tell a family that should be here from one that never is."""
        for name in families:
            self._safely(sink, "set", cat.FAMILY_LIVE, self.common + (name,),
                         0.0 if name in self.absent else 1.0)

    def mark_absent(self, families: Collection[str]) -> None:
        """Families that stop being computed from now on (a hook failed while running):
        the pipeline updates them no more, their series leave the totals and every sink
        that can drop them (rather than staying frozen at their last value), and
        ``kvmetrics_family_live`` says 0 for each."""
        gone = frozenset(families) - self.absent
        if not gone:
            return
        self.absent = self.absent | gone
        self.totals.drop(gone)
        for key in [k for k in self._bound if k[0] in gone]:
            del self._bound[key]
        expected = set(cat.expected_families(self.engine_kind))
        for sink in self.sinks:
            if hasattr(sink, "drop_families"):
                self._safely(sink, "drop_families", self.common, gone)
            self._set_family_live(sink, [name for name in gone if name in expected])

    def _apply(self, spec: cat.MetricSpec, values: tuple[str, ...], amount: float,
               step: int = 0, request_id: str | None = None) -> Violation | None:
        """Add an accepted amount everywhere; the violation instead if the series' total
        would leave the finite floats (exported as +Inf, it would poison every rate())."""
        if spec.name in self.absent:
            return None
        total = self.totals.add(spec, values, amount)
        if total is None:
            return Violation(spec.name, "overflow", step,
                             f"total would overflow adding {amount:g}", request_id)
        if self._invariants is not None:
            self._invariants.observe(spec, values, amount, total)
        bound = self._bound.get((spec.name, values))
        if bound is None:
            full = self.common + values
            for sink in self.sinks:
                self._safely(sink, "inc", spec, full, amount)
            self._bind(spec, values, full)
            return None
        for sink, add in bound:
            try:
                add(amount)
            except Exception:  # an exporter bug must never stop the engine
                self._sink_failed(sink, "inc")
        return None

    def _bind(self, spec: cat.MetricSpec, values: tuple[str, ...],
              full: tuple[str, ...]) -> None:
        """Keep every sink's adder of this series, if each has one (a series a sink
        has not admitted, or a sink without ``bind_counter``, keeps the plain path)."""
        bound = []
        for sink in self.sinks:
            try:  # (even looking the method up may raise, in a broken sink)
                bind = getattr(sink, "bind_counter", None)
                add = bind(spec, full) if bind is not None else None
            except Exception:
                self._sink_failed(sink, "bind_counter")
                add = None
            if add is None:
                return
            bound.append((sink, add))
        self._bound[(spec.name, values)] = tuple(bound)

    def _set_each(self, sink: MetricSink, g: GaugeReadings) -> None:
        """Gauges one by one, for a sink without ``set_gauges``."""
        for spec, values, value in g.samples():
            self._safely(sink, "set", spec, self.common + values, value)

    def _violate(self, violation: Violation) -> None:
        if len(self.violations) < MAX_KEPT_VIOLATIONS:
            self.violations.append(violation)
        if violation.is_rejection:
            if violation.metric in _EVENT_COUNTER_NAMES:  # else no series to count it in
                self._apply(cat.GUARD_REJECTED_INCREMENTS, (violation.metric, violation.kind),
                            1)
        else:
            self._apply(cat.INVARIANT_VIOLATIONS, (str(violation.invariant),), 1)
        report(violation, self.strict)

    def _safely(self, sink: MetricSink, method: str, *args: object) -> None:
        try:
            getattr(sink, method)(*args)
        except Exception:  # an exporter bug must never stop the engine
            self._sink_failed(sink, method)

    def _sink_failed(self, sink: MetricSink, method: str) -> None:
        """Log a sink's first failure (the exception being handled); never raises."""
        key = (id(sink), type(sink))
        if key not in self._failed_sinks:
            self._failed_sinks.add(key)
            log.exception("kvmetrics exporter %s failed in %s; continuing",
                          type(sink).__name__, method)
