"""Drive a scheduler with a model runner until the work is done."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvmetrics.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvmetrics.engine.scheduler import Scheduler


class ModelRunner(Protocol):
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput: ...

    @property
    def has_pending_work(self) -> bool: ...


class EngineLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        result = self.runner.execute(out)
        self.scheduler.update_from_output(out, result)
        return out

    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.runner.has_pending_work

    def run(self, max_steps: int = 1_000_000) -> int:
        """Step until every request finished; returns the steps taken."""
        return run_until_idle(self.step, self.busy, max_steps)


def run_until_idle(step: Callable[[], object], busy: Callable[[], bool],
                   max_steps: int = 1_000_000) -> int:
    """Call ``step`` while ``busy()``; a bound keeps a stalled engine from spinning."""
    steps = 0
    while busy():
        if steps >= max_steps:
            raise RuntimeError(f"requests still unfinished after {max_steps} steps")
        step()
        steps += 1
    return steps
