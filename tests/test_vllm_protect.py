"""The protective recovery's overrides when it is off, and its startup check when on.

Off (the default), every override must hand its arguments to vLLM untouched, so a
vLLM whose private methods changed still runs exactly as it would without
kvmetrics. On, a changed method must stop the scheduler at startup with one line
naming it, never at the first failed load. The base here stands in for a future
vLLM: the same methods with one more parameter each.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvmetrics.integrations.vllm.protect import PROTECTED, ProtectMixin

METHODS = [hook.method for hook in PROTECTED]


class FutureVllm:
    """Each protected method with an extra required parameter; records its calls."""

    def __init__(self, recovery: str) -> None:
        self.vllm_config = SimpleNamespace(additional_config={"kvmetrics": {
            "recovery": recovery}})
        manager = SimpleNamespace(num_cached_block={})
        self.kv_cache_manager = SimpleNamespace(
            coordinator=SimpleNamespace(single_type_managers=[manager]))
        self._inflight_prefills: set[Any] = set()
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []


def _recording(name: str):
    def method(self: FutureVllm, first: Any, extra: Any, *rest: Any, **kwargs: Any) -> Any:
        self.calls.append((name, (first, extra, *rest), kwargs))
        return name
    method.__name__ = name
    return method


for _name in METHODS:
    setattr(FutureVllm, _name, _recording(_name))


class Wrapped(ProtectMixin, FutureVllm):
    pass


def test_off_every_override_passes_its_arguments_through_untouched() -> None:
    scheduler = Wrapped("vllm")
    for name in METHODS:
        assert getattr(scheduler, name)("a", "b", "c", key="k") == name
    assert scheduler.calls == [(name, ("a", "b", "c"), {"key": "k"}) for name in METHODS]


def test_on_a_changed_vllm_method_stops_the_scheduler_at_startup() -> None:
    with pytest.raises(RuntimeError, match=r"KVMETRICS_RECOVERY=evict cannot run on this "
                                           r"vLLM: scheduler\._update_requests_with_invalid"):
        Wrapped("evict")


def test_on_vllms_own_methods_pass_the_check() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvmetrics.integrations.vllm.hooks import signature_problem
    for base in (Scheduler, AsyncScheduler):
        for hook in PROTECTED:
            assert signature_problem(getattr(base, hook.method, None), hook, True) is None, (
                base.__name__, hook.method)


def test_the_checked_base_is_vllms_class_even_under_a_users_own_mixin() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvmetrics.integrations.vllm.hooks import vllm_base
    from kvmetrics.integrations.vllm.scheduler import (
        InstrumentedAsyncScheduler,
        InstrumentedScheduler,
    )

    class OperatorsMixin:
        pass

    class Mine(OperatorsMixin, InstrumentedScheduler):
        pass

    assert vllm_base(InstrumentedScheduler) is Scheduler
    assert vllm_base(InstrumentedAsyncScheduler) is AsyncScheduler
    assert vllm_base(Mine) is Scheduler
    assert vllm_base(Wrapped) is FutureVllm
