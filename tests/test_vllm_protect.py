"""The protective recovery is not in the class when it is off, and checks vLLM when on.

Off (the default), the instrumented class has no protective layer at all: vLLM's own
methods run, so a vLLM whose private methods changed still runs exactly as it would
without kvmetrics. On, the layer sits between kvmetrics' hooks and vLLM's class, and
a changed method must stop the scheduler at startup with one line naming it, never at
the first failed load. The base here stands in for a future vLLM: the same methods
with one more parameter each.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvmetrics.protect.recovery import PROTECTED, ProtectMixin
from kvmetrics.vllm.hooks import vllm_base

pytestmark = pytest.mark.vllm

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


def test_off_the_protective_layer_is_not_in_the_class() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvmetrics.protect.recovery import protect_decided, protected_over
    from kvmetrics.vllm.scheduler import (
        InstrumentedAsyncScheduler,
        InstrumentedMixin,
        InstrumentedScheduler,
    )

    def config(recovery: str) -> SimpleNamespace:
        return SimpleNamespace(additional_config={"kvmetrics": {"recovery": recovery}})

    assert not protect_decided((), {"vllm_config": config("vllm")})
    assert protect_decided((config("evict"),), {})
    assert ProtectMixin not in InstrumentedScheduler.__mro__
    assert ProtectMixin not in InstrumentedAsyncScheduler.__mro__
    for cls, base in ((InstrumentedScheduler, Scheduler),
                      (InstrumentedAsyncScheduler, AsyncScheduler)):
        on = protected_over(cls)
        assert protected_over(cls) is on and issubclass(on, cls)
        mro = on.__mro__
        # The hooks observe what the fix does; the fix calls vLLM's class.
        assert mro.index(InstrumentedMixin) < mro.index(ProtectMixin) < mro.index(base)
        assert vllm_base(on) is base
    with pytest.raises(RuntimeError, match="whose setting is KVMETRICS_RECOVERY=vllm"):
        Wrapped("vllm")


def test_on_a_changed_vllm_method_stops_the_scheduler_at_startup() -> None:
    with pytest.raises(RuntimeError, match=r"KVMETRICS_RECOVERY=evict cannot run on this "
                                           r"vLLM: scheduler\._update_requests_with_invalid"):
        Wrapped("evict")


def test_on_vllms_own_methods_pass_the_check() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvmetrics.vllm.hooks import signature_problem
    for base in (Scheduler, AsyncScheduler):
        for hook in PROTECTED:
            assert signature_problem(getattr(base, hook.method, None), hook, True) is None, (
                base.__name__, hook.method)


def test_the_checked_base_is_vllms_class_even_under_a_users_own_mixin() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvmetrics.vllm.scheduler import (
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
