"""Drive a scheduler with a model runner until the work is done.

In lockstep (vLLM's ``EngineCore.step``) each step schedules, executes and
processes its output. With ``async_scheduling`` the loop is vLLM's
``EngineCore.step_with_batch_queue`` with its queue of two: a call schedules and
starts a new step if there is anything to schedule, and processes the oldest
step's output only when the queue is full or nothing more can be scheduled, so
step n+1 is scheduled before step n's output is known. The runner executes each
step as soon as it is scheduled, in order, as a GPU stream does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from kvmetrics.lab.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvmetrics.lab.engine.scheduler import Scheduler

#: Steps in flight at most under async scheduling (vLLM's max_concurrent_batches).
BATCH_QUEUE_SIZE = 2


class ModelRunner(Protocol):
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput: ...

    @property
    def has_pending_work(self) -> bool: ...


class BatchQueue:
    """vLLM's batch queue, for any scheduler with vLLM's surface.

    ``schedule``/``execute``/``update`` are the scheduler's and runner's calls;
    ``has_requests`` is the scheduler's own "anything left" (vLLM's
    ``has_requests``). :meth:`step` returns the (scheduled, executed) pair it
    started, or None when it only processed an output.
    """

    def __init__(self, schedule: Callable[[], Any], execute: Callable[[Any], Any],
                 update: Callable[[Any, Any], object],
                 has_requests: Callable[[], bool], scheduled_tokens: Callable[[Any], int],
                 size: int = BATCH_QUEUE_SIZE) -> None:
        self._schedule = schedule
        self._execute = execute
        self._update = update
        self._has_requests = has_requests
        self._tokens = scheduled_tokens
        self.size = size
        self.queue: deque[tuple[Any, Any]] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def step(self) -> tuple[Any, Any] | None:
        started = None
        if self._has_requests():
            scheduled = self._schedule()
            started = (scheduled, self._execute(scheduled))
            self.queue.appendleft(started)
            if len(self.queue) < self.size and (self._tokens(scheduled) > 0
                                                or self._has_requests()):
                return started
        elif not self.queue:
            return None
        out, result = self.queue.pop()
        self._update(out, result)
        return started


class EngineLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.batch_queue: BatchQueue | None = None
        if scheduler.config.async_scheduling:
            self.batch_queue = BatchQueue(scheduler.schedule, self._execute,
                                          scheduler.update_from_output, scheduler.has_requests,
                                          lambda out: out.total_num_scheduled_tokens)

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        assert self.batch_queue is not None
        out.in_flight_steps = len(self.batch_queue)
        return self.runner.execute(out)

    def step(self) -> SchedulerOutput:
        """One engine step; returns the step it scheduled (empty if none)."""
        if self.batch_queue is not None:
            started = self.batch_queue.step()
            return started[0] if started is not None else SchedulerOutput(step=self.scheduler.step)
        out = self.scheduler.schedule()
        result = self.runner.execute(out)
        self.scheduler.update_from_output(out, result)
        return out

    def busy(self) -> bool:
        if self.batch_queue is not None:
            # A load in flight always has its request in the scheduler (finished
            # requests keep their blocks until it reports), so has_requests covers it.
            return bool(self.scheduler.has_requests() or self.batch_queue)
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
