"""The guard every counter increment passes before it reaches a client library.

prometheus-client raises ``ValueError`` on a negative increment, and that raise,
inside vLLM's output loop, turned an accounting bug into HTTP 500s. The guard
makes the failure mode observable instead of fatal: a bad amount is dropped,
counted in ``kvmetrics_guard_rejected_increments_total{metric, reason}``, and
logged with the step and request that caused it. Broken invariants
(:mod:`kvmetrics.metrics.invariants`) are reported the same way, in
``kvmetrics_invariant_violations_total{invariant}``. Strict mode (tests, CI)
raises instead.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import CounterIncrement
from kvmetrics.metrics.logs import get_logger
from kvmetrics.metrics.text import short_repr, short_text

log = get_logger("kvmetrics.guard")


#: Longest request id and detail a violation keeps (escaped; the rest is cut, marked
#: with ``...``): a log line stays under about 1 KB whatever the engine passed.
MAX_ID_CHARS = 200
MAX_DETAIL_CHARS = 600
#: Longest shown label value or amount (each) in a violation's detail.
MAX_VALUE_CHARS = 80
#: Most label values shown in a violation's detail (a family has at most a few labels).
MAX_VALUES = 8


class CounterViolationError(RuntimeError):
    """Raised in strict mode when an increment is refused or an invariant breaks."""

    def __init__(self, violation: Violation) -> None:
        super().__init__(violation.describe())
        self.violation = violation


@dataclass(frozen=True, slots=True)
class Violation:
    """A refused increment or a broken invariant, with where it happened.

    ``kind`` is a :data:`~kvmetrics.metrics.catalogue.REJECTION_REASONS` value for an
    increment the guard refused (``metric`` is the counter it was meant for), or
    ``invariant`` for a broken invariant (``invariant`` names it; ``metric`` is the
    family it concerns).
    """

    metric: str
    kind: str  # one of cat.REJECTION_REASONS, or invariant
    step: int
    detail: str
    request_id: str | None = None
    invariant: str | None = None

    def __post_init__(self) -> None:
        # Whoever made it, a violation is fit for one log line: an engine's request id
        # or a detail may be megabytes long, hold line feeds, or not be text at all.
        if self.request_id is not None:
            object.__setattr__(self, "request_id", short_text(self.request_id, MAX_ID_CHARS))
        object.__setattr__(self, "detail", short_text(self.detail, MAX_DETAIL_CHARS))

    @property
    def is_rejection(self) -> bool:
        return self.kind != "invariant"

    def describe(self) -> str:
        who = f" request={self.request_id}" if self.request_id else ""
        if self.is_rejection:
            what = f"refused {self.kind.replace('_', '-')} increment of {self.metric}"
        else:
            what = f"invariant {self.invariant} broken ({self.metric})"
        return f"{what} at step {self.step}{who}: {self.detail}"

    def as_dict(self) -> dict[str, object]:
        """The JSON form the lab's summary lists."""
        out: dict[str, object] = {"metric": self.metric, "step": self.step,
                                  "request_id": self.request_id, "detail": self.detail}
        if self.is_rejection:
            out["reason"] = self.kind
        else:
            out["invariant"] = self.invariant
        return out


def guard_increment(inc: CounterIncrement, step: int) -> tuple[float, Violation | None]:
    """``(amount as a float, None)`` for an increment safe to apply, else ``(nan, the
    violation)``. Total: whatever ``inc`` holds (an array for an amount, ``None`` for the
    label values, a value whose ``__repr__`` or ``==`` raises), this returns and never
    raises."""
    try:
        amount, reason = classify_amount(inc.amount)
        if reason is None:
            try:
                reason = _label_problem(inc)
            except Exception:  # a label value whose == raises (an array, say)
                reason = "label values that cannot be compared"
            if reason is not None:
                return math.nan, Violation(inc.spec.name, "bad_labels", step,
                                           f"labels {_values_text(inc.label_values)}: "
                                           f"{reason}", inc.request_id)
            return amount, None
        detail = f"amount {short_repr(inc.amount)}"
        if reason == "negative":
            detail += f" labels {_labels_text(inc.spec.labels, inc.label_values)}"
        return math.nan, Violation(inc.spec.name, reason, step, detail, inc.request_id)
    except Exception as e:  # a value no check foresaw: refused, never raised into the engine
        return math.nan, Violation(_metric_name(inc), "not_a_number", step,
                                   f"unusable increment ({type(e).__name__})",
                                   _request_id(inc))


def _labels_text(names: object, values: object) -> str:
    """``{'name': 'value', ...}`` with each value bounded and escaped; the values' own
    (bounded) repr when they are not a sequence of values (``None``, say)."""
    if not isinstance(values, tuple | list) or not isinstance(names, dict | tuple | list):
        return short_repr(values, MAX_VALUE_CHARS)
    pairs = [f"{short_repr(n, MAX_VALUE_CHARS)}: {short_repr(v, MAX_VALUE_CHARS)}"
             for n, v in zip(names, values[:MAX_VALUES], strict=False)]
    return "{" + ", ".join(pairs) + "}"


def _values_text(values: object) -> str:
    """``('a', 'b')`` with each value bounded and escaped, at most MAX_VALUES of them."""
    if not isinstance(values, tuple | list):
        return short_repr(values, MAX_VALUE_CHARS)
    shown = [short_repr(v, MAX_VALUE_CHARS) for v in values[:MAX_VALUES]]
    if len(values) > MAX_VALUES:
        shown.append(f"... {len(values) - MAX_VALUES:,} more")
    return "(" + ", ".join(shown) + ("," if len(values) == 1 else "") + ")"


def _request_id(inc: object) -> str | None:
    """The increment's request id, or a bounded repr of whatever stands in its place."""
    try:
        rid = getattr(inc, "request_id", None)
    except Exception:
        return None
    return rid if rid is None or isinstance(rid, str) else short_repr(rid, MAX_VALUE_CHARS)


def _metric_name(inc: object) -> str:
    try:
        name = getattr(getattr(inc, "spec", None), "name", None)
    except Exception:
        name = None
    return name if isinstance(name, str) else "<unknown metric>"


def classify_amount(amount: object) -> tuple[float, str | None]:
    """``(value, None)`` for a finite, non-negative real amount, else ``(nan, reason)``.

    Accepted: any :class:`numbers.Real` but bool (ints of any size that fit a float,
    numpy integer and float scalars, fractions). Refused: bools and anything that is
    not a real number (``not_a_number``: str, None, Decimal, complex), ints too large
    for a float (``overflow``), NaN and infinities (``non_finite``), amounts below
    zero (``negative``).
    """
    kind = type(amount)
    value: float
    # The common cases first: no ABC check, no conversion. ``kind is float`` proves the
    # type, but mypy does not narrow ``amount`` through the local (one type() call kept).
    if kind is float:
        value = amount  # type: ignore[assignment]  # amount is a float: kind is float
    elif kind is int and -_EXACT_INT < amount < _EXACT_INT:  # type: ignore[operator]  # int
        value = float(amount)  # type: ignore[arg-type]  # amount is an int: kind is int
    elif isinstance(amount, bool) or kind.__name__ == "bool_" or \
            not isinstance(amount, numbers.Real):
        return math.nan, "not_a_number"
    else:
        try:
            value = float(amount)
        except OverflowError:
            return math.nan, "overflow"
        except Exception:  # a Real whose __float__ misbehaves
            return math.nan, "not_a_number"
    if value != value or value in _INFINITIES:
        return math.nan, "non_finite"
    if value < 0:
        return math.nan, "negative"
    return value + 0.0, None  # -0.0 -> 0.0


_EXACT_INT = 2**53
_INFINITIES = (math.inf, -math.inf)


def _label_problem(inc: CounterIncrement) -> str | None:
    """Why the increment's own label values cannot be a series of its family, or None."""
    values = inc.label_values
    valid = _VALID_LABEL_SETS.get(inc.spec.name)
    if valid is not None and type(values) is tuple and values in valid:
        return None  # the common case: one hash lookup
    allowed = inc.spec.labels
    if not isinstance(values, tuple) or len(values) != len(allowed):
        return f"expected {len(allowed)} values ({', '.join(allowed)})"
    for value, (name, choices) in zip(values, allowed.items(), strict=True):
        if value not in choices:
            return f"{name}={short_repr(value)} is not one of the catalogue's values"
    return None


#: Every label tuple each counter family may have (all of their labels are enumerable).
_VALID_LABEL_SETS: dict[str, frozenset[tuple[str, ...]]] = {
    spec.name: frozenset(cat.bounded_label_sets(spec)) for spec in cat.COUNTERS}



def report(violation: Violation, strict: bool) -> None:
    """Log a violation once per occurrence; raise it in strict mode."""
    log.error("kvmetrics: %s", violation.describe())
    if strict:
        raise CounterViolationError(violation)
