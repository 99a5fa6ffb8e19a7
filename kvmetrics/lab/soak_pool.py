"""Worker processes for a soak: one scenario at a time each, a dead worker costs one seed.

``concurrent.futures.ProcessPoolExecutor`` cannot do what a long campaign needs:
when one worker dies (the OOM killer, ``kill -9``) it breaks the whole pool and
every result is lost, and on SIGTERM its workers (and its queues' resource
tracker) outlive the parent. Here each worker has its own pipe and is given one
task at a time, so the parent always knows which task a worker holds: a worker
that dies turns exactly that task into an error and is replaced, and on any exit
of the parent (an interrupt included) every worker is terminated by pid. Pipes
need no named semaphores, so no resource-tracker process is started either.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

#: Seconds a terminated worker gets to exit before it is killed.
TERMINATE_GRACE_S = 5.0


def _worker(conn: Connection, run: Callable[[Any], Any], init: Callable[[], None]) -> None:
    # The parent decides what an interrupt means: a Ctrl-C or a hangup reaches the whole
    # process group, and a worker must not print its own traceback for it (the parent
    # then terminates it with SIGTERM).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    init()
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone: nobody wants the result
        if task is None:
            return
        result = run(task)
        try:
            conn.send(result)
        except OSError:  # BrokenPipeError: the parent died (kill -9) while we ran
            return


class _Slot:
    def __init__(self, context: Any, run: Callable[[Any], Any], init: Callable[[], None]):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child, run, init), daemon=True)
        # The worker starts with SIGINT (and SIGHUP) ignored (an ignored signal stays ignored across
        # exec, and Python then installs no KeyboardInterrupt handler): a Ctrl-C, sent to
        # the whole process group, must not print a traceback from a worker that is
        # still starting up. The parent's own handler is back a moment later.
        try:
            previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT,
                                                                      signal.SIGHUP)}
        except ValueError:  # not the main thread: signals are not ours to change
            self.process.start()
        else:
            try:
                self.process.start()
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
        child.close()
        self.index: int | None = None  # the task it holds

    def give(self, index: int, task: Any) -> None:
        self.index = index
        self.conn.send(task)


def run_in_workers(tasks: Sequence[T], jobs: int, run: Callable[[T], R],
                   on_death: Callable[[T, str], R], init: Callable[[], None] = lambda: None,
                   on_start: Callable[[list[int]], None] | None = None) -> Iterator[R]:
    """``run(task)`` for every task in ``jobs`` spawned processes, yielded in task order.
    A worker that dies yields ``on_death(task, why)`` for the task it held. ``run``,
    ``init`` and the tasks must be picklable (module-level functions, plain data)."""
    # spawn, not fork: a forked child of a process that already ran torch's thread
    # pools can deadlock, and spawn behaves the same on every platform.
    context = multiprocessing.get_context("spawn")
    slots: list[_Slot] = []
    done: dict[int, R] = {}
    todo = iter(enumerate(tasks))
    following = 0
    try:
        for _ in range(min(jobs, len(tasks))):
            slots.append(_Slot(context, run, init))
        if on_start is not None:
            on_start([s.process.pid for s in slots if s.process.pid is not None])
        for slot in slots:
            _feed(slot, todo, tasks)
        while following < len(tasks):
            while following in done:
                yield done.pop(following)
                following += 1
            if following >= len(tasks):
                break
            busy = {s.conn: s for s in slots if s.index is not None}
            sentinels = {s.process.sentinel: s for s in busy.values()}
            for ready in wait([*busy, *sentinels]):
                slot = busy.get(ready) or sentinels[ready]
                index = slot.index
                if index is None or slot not in slots:
                    continue  # its result and its exit were both ready: handled once
                slot.index = None
                try:
                    result = slot.conn.recv() if slot.conn.poll() else None
                except (EOFError, OSError):
                    result = None
                if result is None:  # no result: the worker died holding the task
                    slot.process.join(TERMINATE_GRACE_S)
                    done[index] = on_death(tasks[index], _why(slot.process.exitcode))
                    slot.conn.close()
                    slots[slots.index(slot)] = slot = _Slot(context, run, init)
                else:
                    done[index] = result
                _feed(slot, todo, tasks)
    finally:
        _stop(slots)


def _feed(slot: _Slot, todo: Iterator[tuple[int, Any]], tasks: Sequence[Any]) -> None:
    nxt = next(todo, None)
    if nxt is not None:
        slot.give(*nxt)


def _why(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"the worker process died ({name})"
    return f"the worker process exited with code {exitcode}"


def _stop(slots: list[_Slot]) -> None:
    """Ask idle workers to leave, terminate busy ones, and kill any that linger."""
    for slot in slots:
        try:
            if slot.index is None and slot.process.is_alive():
                slot.conn.send(None)
            else:
                slot.process.terminate()
        except (OSError, ValueError):
            pass
    for slot in slots:
        slot.process.join(TERMINATE_GRACE_S)
        if slot.process.is_alive():
            os.kill(slot.process.pid, signal.SIGKILL)
            slot.process.join()
        slot.conn.close()
    sys.stderr.flush()
