"""Soak campaigns: many small seeded scenarios with random faults, policies and pressure.

Each scenario is fully described by its seed, so a failure prints the one
command that reproduces it. Invariant breaks, guard refusals and verifier
findings are tallied separately; in the unified accounting all must stay zero.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmetrics.lab.config import LabConfig
from kvmetrics.lab.runner import run_lab


@dataclass
class ScenarioOutcome:
    seed: int
    engine: str
    invariant_violations: int
    guard_rejected_increments: int
    verification_failed_blocks: int
    error: str | None = None

    @property
    def clean(self) -> bool:
        return not (self.invariant_violations or self.guard_rejected_increments
                    or self.verification_failed_blocks or self.error)


@dataclass
class SoakReport:
    scenarios: int = 0
    invariant_violations: int = 0
    guard_rejected_increments: int = 0
    verification_failed_blocks: int = 0
    errors: int = 0
    wall_seconds: float = 0.0
    failures: list[ScenarioOutcome] = field(default_factory=list)

    def add(self, outcome: ScenarioOutcome) -> None:
        self.scenarios += 1
        self.invariant_violations += outcome.invariant_violations
        self.guard_rejected_increments += outcome.guard_rejected_increments
        self.verification_failed_blocks += outcome.verification_failed_blocks
        self.errors += outcome.error is not None
        if not outcome.clean:
            self.failures.append(outcome)

    def as_dict(self) -> dict[str, object]:
        return {
            "scenarios": self.scenarios,
            "invariant_violations": self.invariant_violations,
            "guard_rejected_increments": self.guard_rejected_increments,
            "verification_failed_blocks": self.verification_failed_blocks,
            "errors": self.errors,
            "wall_seconds": round(self.wall_seconds, 2),
            "failing_seeds": [f"{o.engine}:{o.seed}" for o in self.failures[:20]],
        }


def scenario_config(seed: int, engine: str, accounting: str, verify: str,
                    recovery: str = "vllm") -> LabConfig:
    """A random but reproducible scenario: small enough to run in a fraction of a second."""
    rng = random.Random(seed)
    block_size = rng.choice((4, 8, 16))
    return LabConfig(
        engine=engine,
        workload=rng.choice(("chat", "agent", "rag", "random", "mixed")),
        max_requests=rng.randint(8, 40),
        block_size=block_size,
        # From "barely fits the longest request" to roomy: preemption pressure varies.
        num_gpu_blocks=rng.choice((1, 2, 4)) * (2048 // block_size) + 2,
        max_num_seqs=rng.choice((2, 8, 32)),
        max_num_batched_tokens=rng.choice((64, 256, 1024)),
        fault_rate=rng.choice((0.0, 0.05, 0.2, 0.5)),
        fault_mode=rng.choice(("sync", "async", "mixed")),
        policy=rng.choice(("recompute", "fail")),
        accounting=accounting,
        recovery=recovery,
        store_blocks=rng.choice((0, 64, 1024)),
        abort_rate=rng.choice((0.0, 0.1)),
        verify=verify,
        seed=seed,
        progress=False,
    )


def run_scenario(seed: int, engine: str, accounting: str = "unified",
                 verify: str = "full", recovery: str = "vllm") -> ScenarioOutcome:
    cfg = scenario_config(seed, engine, accounting, verify, recovery)
    try:
        result = run_lab(cfg)
    except Exception as e:  # a crash is a finding, reported with its seed
        return ScenarioOutcome(seed, engine, 0, 0, 0, error=f"{type(e).__name__}: {e}")
    summary = result.summary
    return ScenarioOutcome(seed, engine, summary["invariant_violations"],
                           summary["guard_rejected_increments"],
                           summary["verification"]["failed_blocks"])


def soak(num_scenarios: int, engines: Sequence[str] = ("reference",), seed: int = 0,
         accounting: str = "unified", verify: str = "full",
         on_progress: Callable[[SoakReport], None] | None = None,
         recovery: str = "vllm") -> SoakReport:
    report = SoakReport()
    start = time.monotonic()
    for i in range(num_scenarios):
        for engine in engines:
            report.add(run_scenario(seed + i, engine, accounting, verify,
                                    recovery if engine == "reference" else "vllm"))
        if on_progress is not None:
            on_progress(report)
    report.wall_seconds = time.monotonic() - start
    return report
