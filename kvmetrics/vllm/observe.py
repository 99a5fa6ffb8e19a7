"""How a hook runs beside vLLM's method without ever raising into it.

Every hook on vLLM's rarer paths is built by :func:`observed_call`: vLLM's method is
called exactly once, with the arguments vLLM passed, and its result or exception goes
back to vLLM untouched. What kvmetrics does around it is an *observer*, a function
handed vLLM's raw objects (the scheduler, the argument tuple and dict, the result),
that runs only inside :func:`guarded`: every argument extraction, attribute read and
bookkeeping step is the observer's, so nothing kvmetrics evaluates is outside the
guard. A hook is declared, not written: :class:`Override` makes a scheduler method
from its observers, :func:`wrapped` an instance method of vLLM's helper objects.

The two overrides of every step (``schedule``, ``update_from_output``) are written by
hand for their cost (:mod:`.scheduler`); their inline code is inside ``try`` blocks
that count a fault the same way (:func:`report_fault`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import thread_time_ns
from typing import TYPE_CHECKING, Any

from kvmetrics.metrics.guard import CounterViolationError
from kvmetrics.vllm.exporting import LOGGER

log = logging.getLogger(LOGGER)

#: ``observer(kv, scheduler, args, kwargs)`` before vLLM's method (returns what the
#: after-observer is handed; None skips it), ``observer(kv, scheduler, seen, args,
#: kwargs, result)`` after it.
Observer = Callable[..., Any]

_unreported: set[str] = set()


def report_fault(scheduler: Any, hook: str, problem: str | None = None) -> None:
    """Count and log a fault of ``hook`` on the scheduler's state; never raises. Only
    when that state itself is broken is the fault left uncounted, and logged once."""
    try:
        scheduler._kv.fault(hook, problem)
    except Exception:
        if hook not in _unreported:
            _unreported.add(hook)
            log.exception("kvmetrics' own state is broken: a fault of hook %s cannot be "
                          "counted; the engine continues", hook)


def guarded(scheduler: Any, hook: str, observer: Observer, *raw: Any) -> Any:
    """``observer(kv, scheduler, *raw)`` timed; None when ``hook`` is off or it raised
    (counted and logged: :func:`report_fault`). Only strict mode's
    :class:`CounterViolationError` passes, on purpose."""
    start = thread_time_ns()
    kv = None
    try:
        kv = scheduler._kv
        if hook in kv.off:
            return None
        return observer(kv, scheduler, *raw)
    except CounterViolationError:
        raise
    except Exception:
        report_fault(scheduler, hook)
        return None
    finally:
        if kv is not None:
            try:
                kv.timed(thread_time_ns() - start)
            except Exception:
                report_fault(scheduler, hook)


def observed_call(scheduler: Any, hook: str, call: Callable[..., Any],
                  before: Observer | None, after: Observer | None, always: bool,
                  args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """vLLM's ``call(*args, **kwargs)`` once, between two guarded observers (``always``:
    the after-observer runs also when vLLM's method raised, with result None)."""
    seen = True if before is None else guarded(scheduler, hook, before, args, kwargs)
    if after is None or seen is None:
        return call(*args, **kwargs)
    if not always:
        result = call(*args, **kwargs)
        guarded(scheduler, hook, after, seen, args, kwargs, result)
        return result
    result = None
    try:
        result = call(*args, **kwargs)
        return result
    finally:
        guarded(scheduler, hook, after, seen, args, kwargs, result)


class Override:
    """A scheduler method of vLLM's, observed: ``name = Override(hook, before, after)``
    in a mixin's body becomes the override that calls the next class's ``name``."""

    def __init__(self, hook: str, before: Observer | None = None,
                 after: Observer | None = None, always: bool = False) -> None:
        self.hook, self.before, self.after, self.always = hook, before, after, always

    if TYPE_CHECKING:
        # What the type checker should see: at class creation the attribute becomes a
        # function that takes vLLM's arguments, whatever the method's signature.
        def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __set_name__(self, owner: type, name: str) -> None:
        hook, before, after, always = self.hook, self.before, self.after, self.always

        def override(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            return observed_call(scheduler, hook, getattr(super(owner, scheduler), name),
                                 before, after, always, args, kwargs)

        override.__name__ = name
        override.__qualname__ = f"{owner.__qualname__}.{name}"
        override.__doc__ = f"vLLM's ``{name}``, observed by kvmetrics' hook {hook}."
        setattr(owner, name, override)


def wrapped(scheduler: Any, hook: str, call: Callable[..., Any], before: Observer | None = None,
            after: Observer | None = None, always: bool = False) -> Callable[..., Any]:
    """vLLM's bound method ``call`` of a helper object, observed (for its instance)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return observed_call(scheduler, hook, call, before, after, always, args, kwargs)

    wrapper.__name__ = getattr(call, "__name__", hook)
    return wrapper

