"""The guard every counter increment passes before it reaches a client library.

prometheus-client raises ``ValueError`` on a negative increment, and that raise,
inside vLLM's output loop, turned an accounting bug into HTTP 500s. The guard
makes the failure mode observable instead of fatal: a bad amount is dropped,
counted in ``kvmetrics_counter_violations_total{metric, kind}``, and logged with
the step and request that caused it. Strict mode (tests, CI) raises instead.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from kvmetrics.metrics.events import CounterIncrement

log = logging.getLogger("kvmetrics.guard")


class CounterViolationError(RuntimeError):
    """Raised in strict mode when an increment or an invariant is refused."""

    def __init__(self, violation: Violation) -> None:
        super().__init__(violation.describe())
        self.violation = violation


@dataclass(frozen=True, slots=True)
class Violation:
    metric: str
    kind: str  # negative | non_finite | invariant
    step: int
    detail: str
    request_id: str | None = None

    def describe(self) -> str:
        who = f" request={self.request_id}" if self.request_id else ""
        return f"{self.kind} violation on {self.metric} at step {self.step}{who}: {self.detail}"


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
    log.error("kvmetrics refused a counter update: %s", violation.describe())
    if strict:
        raise CounterViolationError(violation)
