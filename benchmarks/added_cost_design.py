"""The order of the code paths and the statistics of ``benchmarks.vllm_added_cost``.

Pure functions, no vLLM: the balanced order in which one scheduler switches between
its modes, the per-process estimate with its 95 % interval, and how the processes of
one size are combined into a figure and a verdict.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

#: Batches of consecutive blocks a process's steps are cut into for its interval.
BATCHES = 16
#: Two-sided 95 % quantile of Student's t with BATCHES - 1 degrees of freedom.
T95 = 2.131


def balanced_order(modes: int) -> list[int]:
    """A cyclic order of ``modes`` symbols, each ``modes`` times, in which every
    ordered pair (a mode after itself included) is adjacent exactly once (a de Bruijn
    sequence of order 2). Repeated, every mode follows every mode equally often, so
    what one step leaves to the next lands on every mode alike and cancels from their
    differences."""
    if modes < 1:
        raise ValueError("at least one mode")
    word = [0] * 3
    order: list[int] = []

    def extend(t: int, p: int) -> None:  # the FKM construction over Lyndon words
        if t > 2:
            if 2 % p == 0:
                order.extend(word[1:p + 1])
            return
        word[t] = word[t - p]
        extend(t + 1, p)
        for symbol in range(word[t - p] + 1, modes):
            word[t] = symbol
            extend(t + 1, t)

    extend(1, 1)
    return order


def follows(order: list[int]) -> dict[tuple[int, int], int]:
    """How often each mode follows each mode in ``order`` repeated (cyclic)."""
    pairs: dict[tuple[int, int], int] = {}
    for i, mode in enumerate(order):
        key = (order[i - 1], mode)
        pairs[key] = pairs.get(key, 0) + 1
    return pairs


@dataclass(frozen=True)
class Estimate:
    """A per-step cost in microseconds with its 95 % interval."""

    us: float
    low: float
    high: float

    def holds(self, value: float) -> bool:
        return self.low <= value <= self.high

    def decides_below(self, bound: float) -> bool | None:
        """True / False when the whole interval is at or below / above ``bound``,
        else None."""
        if self.high <= bound:
            return True
        if self.low > bound:
            return False
        return None

    def text(self, unit: str = "us/step") -> str:
        return f"{unit} (95 % CI {self.low:.2f}..{self.high:.2f})"


def batch_estimate(batches: list[float]) -> Estimate:
    """The mean of per-batch differences with a t interval from their spread (the
    batches are consecutive stretches, so slow and fast stretches stay in it)."""
    centre = statistics.fmean(batches)
    if len(batches) < 2:
        return Estimate(centre, -math.inf, math.inf)
    half = T95 * statistics.stdev(batches) / math.sqrt(len(batches))
    return Estimate(centre, centre - half, centre + half)


def combined(per_process: list[Estimate]) -> Estimate:
    """The processes of one size: the mean of their estimates, and an interval that
    spans every process's interval (so the spread between processes is in it)."""
    return Estimate(statistics.fmean(e.us for e in per_process),
                    min(e.low for e in per_process), max(e.high for e in per_process))


def verdict(difference: Estimate, controls: list[Estimate],
            bound: float = 0.0) -> tuple[str, bool | None]:
    """Whether ``difference`` is at or below ``bound``, given only when it can be:
    two processes or more, and in each of them an A/A control whose interval holds 0
    (a process whose control is off did not resolve its differences either)."""
    if len(controls) < 2:
        return "unresolved (one process)", None
    if not all(control.holds(0.0) for control in controls):
        return "unresolved (A/A control off)", None
    below = difference.decides_below(bound)
    if below is None:
        return "unresolved (the CI holds the bound)", None
    return "resolved", below
