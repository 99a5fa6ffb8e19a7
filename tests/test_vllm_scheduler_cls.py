"""The one ``--scheduler-cls`` class follows vLLM's own decision on async scheduling.

vLLM resolves ``--scheduler-cls`` with ``SchedulerConfig.get_scheduler_cls()`` and the
engine core builds the class it gets with keyword arguments. With async scheduling
decided on, a plain ``Scheduler`` subclass cannot schedule a request again while its
previous step is in flight (vLLM warns of "degraded performance" for exactly that
case), so the class must then be built over ``AsyncScheduler``; with it off, over
the plain ``Scheduler``, as vLLM itself would choose. The oracle for behaviour is
vLLM's own class for the same decision (``scheduler_cls`` unset): the instrumented
scheduler must schedule the same tokens.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvmetrics.lab.engine.executor import SimulatedExecutor
from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.lab.engine.tokens import ExplicitTokens
from kvmetrics.lab.vllm import builder
from kvmetrics.lab.vllm.engine import VllmEngine
from kvmetrics.vllm.hooks import vllm_base
from kvmetrics.vllm.scheduler import (
    InstrumentedAsyncScheduler,
    InstrumentedScheduler,
)

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTED = "kvmetrics.vllm.scheduler.InstrumentedScheduler"


def config(decided: bool) -> SchedulerConfig:
    return SchedulerConfig(block_size=16, num_gpu_blocks=64, max_num_seqs=8,
                           max_num_batched_tokens=256, max_model_len=512,
                           async_scheduling=decided)


def build_like_engine_core(vllm_config, cfg: SchedulerConfig):
    """What vLLM's EngineCore does: resolve the class, then call it with keywords only
    (the ones this vLLM's Scheduler takes; ``hash_block_size`` is new in 0.33)."""
    from vllm.v1.structured_output import StructuredOutputManager

    cls = vllm_config.scheduler_config.get_scheduler_cls()
    offered = dict(vllm_config=vllm_config, kv_cache_config=builder.build_kv_cache_config(cfg),
                   structured_output_manager=StructuredOutputManager(vllm_config),
                   include_finished_set=False, log_stats=True, block_size=cfg.block_size,
                   hash_block_size=cfg.block_size)
    takes = inspect.signature(Scheduler.__init__).parameters
    return cls, cls(**{k: v for k, v in offered.items() if k in takes})


def test_the_documented_class_is_the_one_tested() -> None:
    for doc in ("README.md", "docs/user-guide.md"):
        assert f"--scheduler-cls {DOCUMENTED}" in (ROOT / doc).read_text(), doc
    assert builder.instrumented_cls(config(True)) == DOCUMENTED


@pytest.mark.parametrize("decided", [True, False], ids=["async", "sync"])
def test_get_scheduler_cls_and_engine_core_build_vllms_choice(decided: bool) -> None:
    cfg = config(decided)
    vllm_config = builder.build_vllm_config(cfg, scheduler_cls=DOCUMENTED)
    assert vllm_config.scheduler_config.async_scheduling is decided
    cls, sched = build_like_engine_core(vllm_config, cfg)
    assert cls is InstrumentedScheduler
    assert isinstance(sched, AsyncScheduler) is decided
    assert type(sched) is (InstrumentedAsyncScheduler if decided else InstrumentedScheduler)
    assert vllm_base(type(sched)) is (AsyncScheduler if decided else Scheduler)
    assert sched.kvmetrics_broken_hooks == {}
    # vLLM's own pick for the same decision, for comparison.
    vllm_config.scheduler_config.scheduler_cls = None
    assert issubclass(type(sched), vllm_config.scheduler_config.get_scheduler_cls())
    sched.shutdown()


def test_vllms_own_decision_on_this_platform_is_followed() -> None:
    # async_scheduling left to vLLM: the CPU platform decides it off.
    cfg = config(False)
    vllm_config = builder.build_vllm_config(cfg, scheduler_cls=DOCUMENTED)
    from vllm.config import SchedulerConfig as VllmSchedulerConfig

    assert VllmSchedulerConfig.__dataclass_fields__["async_scheduling"].default is None
    _, sched = build_like_engine_core(vllm_config, cfg)
    assert isinstance(sched, AsyncScheduler) is bool(
        vllm_config.scheduler_config.async_scheduling)
    sched.shutdown()


def scheduled_twice(decided: bool, scheduler_cls: str | None) -> list[dict[str, int]]:
    """Tokens per request of two schedule() calls with no output in between: the
    second is what async scheduling overlaps with the step in flight."""
    engine = VllmEngine(config(decided), SimulatedExecutor(FaultPlan()),
                        scheduler_cls=scheduler_cls)
    engine.add_request(Request("r", ExplicitTokens(list(range(100, 148))), 8))
    sched = engine.scheduler
    outs = [dict(sched.schedule().num_scheduled_tokens) for _ in range(2)]
    engine.close()
    return outs


@pytest.mark.parametrize("decided", [True, False], ids=["async", "sync"])
def test_it_schedules_exactly_as_vllms_own_class(decided: bool) -> None:
    ours = scheduled_twice(decided, DOCUMENTED)
    assert ours == scheduled_twice(decided, None)
    # Under async scheduling the next decode token is scheduled while the prompt's
    # step is still in flight; without it, nothing is.
    assert ours == ([{"r": 48}, {"r": 1}] if decided else [{"r": 48}, {}])


def test_an_operators_subclass_follows_too() -> None:
    class Mine(InstrumentedScheduler):
        pass

    for decided in (True, False):
        cfg = config(decided)
        vllm_config = builder.build_vllm_config(cfg, scheduler_cls=Mine)
        _, sched = build_like_engine_core(vllm_config, cfg)
        assert isinstance(sched, Mine)
        assert isinstance(sched, AsyncScheduler) is decided
        assert vllm_base(type(sched)) is (AsyncScheduler if decided else Scheduler)
        sched.shutdown()


def test_the_async_name_still_works() -> None:
    cfg = config(True)
    vllm_config = builder.build_vllm_config(cfg, scheduler_cls=builder.INSTRUMENTED_ASYNC)
    _, sched = build_like_engine_core(vllm_config, cfg)
    assert type(sched) is InstrumentedAsyncScheduler
    sched.shutdown()
