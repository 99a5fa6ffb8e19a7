"""The engines a lab run can drive, behind one small surface, and where they come from.

A lab engine takes :class:`WorkItem`s, steps, and hands out the step events of
its scheduler; the data plane (or the tensor-less executor when verification is
off) plays the model.

The reference engine is built in. Other engines register under the entry point
group :data:`ENTRY_POINT_GROUP` (kvmetrics' own ``pyproject.toml`` declares
``vllm = "kvmetrics.lab.vllm.lab:VllmLabEngine"``), so the lab's runner never
imports vLLM's harness (:mod:`kvmetrics.lab.vllm`): it loads one only when a run asks
for it by name. An
entry point names a class (or factory) taking ``(LabConfig, SchedulerConfig,
FaultPlan)`` and returning a :class:`LabEngine`.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Protocol

from kvmetrics.lab.config import LabConfig, LabError
from kvmetrics.lab.engine.connector import StoreConnector
from kvmetrics.lab.engine.executor import EOS_TOKEN_ID, SimulatedExecutor, worker_tokens
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.loop import EngineLoop
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.scheduler import Scheduler, SchedulerConfig
from kvmetrics.lab.workload import WorkItem
from kvmetrics.metrics.events import StepEvents

#: Chance per sampled token that a request which may stop early emits end-of-sequence.
EOS_PROBABILITY = 0.02


class LabEngine(Protocol):
    kind: str

    def add(self, item: WorkItem, max_tokens: int | None) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> int:
        """Run one step; returns the tokens it scheduled (0 while only waiting)."""
        ...

    def busy(self) -> bool: ...

    def close(self) -> None: ...

    def drain_events(self) -> list[StepEvents]: ...

    def num_unfinished(self) -> int: ...

    @property
    def findings(self) -> list[Any]: ...


def make_request(item: WorkItem, max_tokens: int | None) -> Request:
    return Request(item.request_id, item.prompt,
                   max_tokens=max_tokens if max_tokens is not None else item.max_tokens,
                   eos_token_id=EOS_TOKEN_ID if item.stop_on_eos else None)


def make_runner(cfg: LabConfig, faults: FaultPlan, store: ExternalStoreIndex | None,
                tokens: Any) -> Any:
    """The torch data plane with its verifier, or the tensor-less executor when off."""
    if cfg.verify == "off":
        return SimulatedExecutor(faults, store, eos_probability=EOS_PROBABILITY)
    from kvmetrics.lab.kv.runner import TorchModelRunner

    try:
        return TorchModelRunner(
            block_size=cfg.block_size, num_gpu_blocks=cfg.num_gpu_blocks, store=store,
            faults=faults, tokens=tokens, device=cfg.device, kv_dim=cfg.kv_dim,
            verify=cfg.verify, verify_fraction=cfg.verify_fraction, seed=cfg.seed,
            strict=cfg.strict, eos_probability=EOS_PROBABILITY)
    except ValueError as e:  # e.g. --device cuda without a GPU
        raise LabError(str(e)) from None


class ReferenceEngine:
    kind = "reference"

    def __init__(self, cfg: LabConfig, sched_cfg: SchedulerConfig, faults: FaultPlan) -> None:
        capacity = cfg.store_capacity
        self.store = ExternalStoreIndex(capacity) if capacity else None
        connector = (StoreConnector(self.store, cfg.block_size, cfg.fault_mode, cfg.seed)
                     if self.store is not None else None)
        self.scheduler = Scheduler(sched_cfg, connector)
        requests = self.scheduler.requests
        self.runner = make_runner(cfg, faults, self.store, worker_tokens(
            lambda rid, start, end: requests[rid].token_ids(start, end),
            lambda rid: requests[rid].num_prompt_tokens, EOS_PROBABILITY))
        self.loop = EngineLoop(self.scheduler, self.runner)

    def add(self, item: WorkItem, max_tokens: int | None) -> None:
        self.scheduler.add_request(make_request(item, max_tokens))

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def step(self) -> int:
        return self.loop.step().total_num_scheduled_tokens

    def busy(self) -> bool:
        return self.loop.busy()

    def close(self) -> None:
        pass

    def drain_events(self) -> list[StepEvents]:
        return self.scheduler.drain_events()

    def num_unfinished(self) -> int:
        s = self.scheduler
        return len(s.running) + len(s.waiting) + len(s.kv_holding)

    @property
    def findings(self) -> list[Any]:
        return list(getattr(self.runner, "findings", []))


ENTRY_POINT_GROUP = "kvmetrics.lab_engines"

EngineFactory = Callable[[LabConfig, SchedulerConfig, FaultPlan], LabEngine]
BUILTIN: dict[str, EngineFactory] = {"reference": ReferenceEngine}


def _registered() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)
            if ep.name not in BUILTIN}


def engine_names() -> tuple[str, ...]:
    """Every engine a run may ask for: the built-in one, then the registered ones."""
    return (*BUILTIN, *sorted(_registered()))


def load_engine(name: str) -> EngineFactory:
    """The factory of engine ``name``; a missing engine or dependency is a LabError."""
    factory = BUILTIN.get(name)
    if factory is not None:
        return factory
    registered = _registered()
    ep = registered.get(name)
    if ep is None:
        raise LabError(f"unknown engine {name!r} (choose from {', '.join(engine_names())})")
    try:
        return ep.load()
    except ImportError as e:
        # The integration's own message says what to install (e.g. vLLM's light install).
        raise LabError(f"--engine {name} is not available: {e}") from None


def build_engine(cfg: LabConfig, sched_cfg: SchedulerConfig, faults: FaultPlan) -> LabEngine:
    return load_engine(cfg.engine)(cfg, sched_cfg, faults)
