"""Timing helpers: best-of-N wall time, ratios measured side by side in one run."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Row:
    benchmark: str
    case: str
    value: float
    unit: str
    target: str = ""
    ok: bool | None = None

    def cells(self) -> list[str]:
        verdict = "" if self.ok is None else ("ok" if self.ok else "MISS")
        return [self.benchmark, self.case, f"{self.value:.4g} {self.unit}", self.target, verdict]


def best_time(fn: Callable[[], object], repeat: int = 5, number: int = 1) -> float:
    """Smallest mean seconds per call over ``repeat`` rounds of ``number`` calls."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best


def interleaved_ratio(a: Callable[[], object], b: Callable[[], object],
                      rounds: int = 7) -> tuple[float, float, float]:
    """Time a and b alternately (so drift hits both) and return (t_a, t_b, t_a / t_b)."""
    ta = tb = float("inf")
    for i in range(rounds):
        # Alternate which side goes first, so a state that drifts over time
        # (longer sequences, a warmer cache) favours neither.
        if i % 2:
            tb = min(tb, best_time(b, repeat=1))
            ta = min(ta, best_time(a, repeat=1))
        else:
            ta = min(ta, best_time(a, repeat=1))
            tb = min(tb, best_time(b, repeat=1))
    return ta, tb, ta / tb


def render(rows: list[Row]) -> str:
    header = ["benchmark", "case", "result", "target", ""]
    table = [header] + [r.cells() for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def interleaved_cpu_ratios(a: Callable[[], object], b: Callable[[], object], rounds: int = 9,
                           number: int = 5) -> tuple[float, float, list[float]]:
    """CPU time of this thread per call of a and of b, alternated round by round (which
    goes first alternates too); returns (median t_a, median t_b, per-round ratios a/b).

    Thread CPU time, not wall time: on a shared machine another process's load shows
    up in wall time but not in the CPU this code itself spends.
    """
    ta: list[float] = []
    tb: list[float] = []

    def cpu(fn: Callable[[], object]) -> float:
        start = time.thread_time()
        for _ in range(number):
            fn()
        return (time.thread_time() - start) / number

    for i in range(rounds):
        if i % 2:
            tb.append(cpu(b))
            ta.append(cpu(a))
        else:
            ta.append(cpu(a))
            tb.append(cpu(b))
    ratios = sorted(x / y for x, y in zip(ta, tb, strict=True))
    return sorted(ta)[len(ta) // 2], sorted(tb)[len(tb) // 2], ratios


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the kernel's pick), for servers under test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
