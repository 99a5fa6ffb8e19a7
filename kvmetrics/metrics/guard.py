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

import logging
import math
from dataclasses import dataclass

from kvmetrics.metrics.events import CounterIncrement

log = logging.getLogger("kvmetrics.guard")


class CounterViolationError(RuntimeError):
    """Raised in strict mode when an increment is refused or an invariant breaks."""

    def __init__(self, violation: Violation) -> None:
        super().__init__(violation.describe())
        self.violation = violation


@dataclass(frozen=True, slots=True)
class Violation:
    """A refused increment or a broken invariant, with where it happened.

    ``kind`` is ``negative`` or ``non_finite`` for an increment the guard refused
    (``metric`` is the counter it was meant for), or ``invariant`` for a broken
    invariant (``invariant`` names it; ``metric`` is the family it concerns).
    """

    metric: str
    kind: str  # negative | non_finite | invariant
    step: int
    detail: str
    request_id: str | None = None
    invariant: str | None = None

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


def check_increment(inc: CounterIncrement, step: int) -> Violation | None:
    """Return the violation an increment would cause, or None if it is safe to apply."""
    amount = inc.amount
    if isinstance(amount, bool) or not isinstance(amount, int | float):
        return Violation(inc.spec.name, "non_finite", step,
                         f"amount {amount!r} is not a number", inc.request_id)
    if not math.isfinite(amount):
        return Violation(inc.spec.name, "non_finite", step, f"amount {amount}", inc.request_id)
    if amount < 0:
        labels = dict(zip(inc.spec.labels, inc.label_values, strict=False))
        return Violation(inc.spec.name, "negative", step,
                         f"amount {amount} labels {labels}", inc.request_id)
    return None


def report(violation: Violation, strict: bool) -> None:
    """Log a violation once per occurrence; raise it in strict mode."""
    log.error("kvmetrics: %s", violation.describe())
    if strict:
        raise CounterViolationError(violation)
