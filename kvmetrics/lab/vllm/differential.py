"""Run one workload and fault plan through the reference engine and through vLLM.

Both runs get fresh requests with the same ids and tokens, the same arrival
steps, the same runner (a fresh ``SimulatedExecutor`` with the same fault plan)
and an external store warmed with the same prompts in the same order (each
engine hashes them its own way, so the store's LRU order is the same). What
comes out is comparable: per-request outcomes and the pipeline's counter totals.

vLLM runs either its own recovery path or, with kvmetrics' protective mode on,
the complete fix; :func:`vllm_faithful` and :func:`kvmetrics_fix` give the
reference configuration that matches each exactly, async scheduling included.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvmetrics.lab.engine.config import RECOVERY_MODES
from kvmetrics.lab.engine.connector import StoreConnector
from kvmetrics.lab.engine.executor import EOS_TOKEN_ID, SimulatedExecutor
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.loop import EngineLoop
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.scheduler import Scheduler, SchedulerConfig
from kvmetrics.lab.engine.tokens import ExplicitTokens
from kvmetrics.metrics.pipeline import MetricsPipeline


def installed_async_caching() -> str:
    """Where the installed vLLM's AsyncScheduler caches blocks after an output."""
    import vllm

    parts = str(getattr(vllm, "__version__", "")).split(".")
    older = len(parts) > 1 and parts[0] == "0" and parts[1].isdigit() and int(parts[1]) <= 32
    return "placeholders" if older else "in_flight"


def vllm_faithful(config: SchedulerConfig) -> SchedulerConfig:
    """The reference engine as the installed vLLM is, its recovery-path defects included."""
    return replace(config, recovery="vllm", **RECOVERY_MODES["vllm"],
                   async_caching=installed_async_caching())


def kvmetrics_fix(config: SchedulerConfig) -> SchedulerConfig:
    """The complete fix, on the reference engine as on vLLM's protective mode."""
    return replace(config, recovery="evict", **RECOVERY_MODES["evict"],
                   async_caching=installed_async_caching())


def vllm_recovery(config: SchedulerConfig) -> str:
    """The ``KVMETRICS_RECOVERY`` under which vLLM matches ``config`` exactly."""
    modes = {"async_admission": config.async_admission, "async_rollback": config.async_rollback}
    if RECOVERY_MODES.get(config.recovery) == modes:
        return config.recovery
    raise ValueError(f"recovery/async_admission/async_rollback {config.recovery}/"
                     f"{config.async_admission}/{config.async_rollback} has no vLLM "
                     "counterpart: use vllm_faithful() or kvmetrics_fix()")


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    tokens: tuple[int, ...]
    max_tokens: int
    arrival_step: int = 0
    eos: bool = False

    def make(self) -> Request:
        return Request(self.request_id, ExplicitTokens(self.tokens), self.max_tokens,
                       eos_token_id=EOS_TOKEN_ID if self.eos else None,
                       arrival_step=self.arrival_step)


@dataclass
class Workload:
    requests: list[RequestSpec]
    #: Prompts whose full blocks are put into the external store before the run.
    warm: list[tuple[int, ...]] = field(default_factory=list)
    store_blocks: int = 256
    load_mode: str = "sync"
    eos_probability: float = 0.0
    async_delay_steps: int = 1


def random_workload(seed: int, num_requests: int = 40, *, block_size: int = 16,
                    num_docs: int = 6, doc_blocks: tuple[int, int] = (2, 8),
                    suffix: tuple[int, int] = (1, 40), max_tokens: tuple[int, int] = (1, 12),
                    arrival_every: int = 2, warm_docs: int = 3, load_mode: str = "sync",
                    store_blocks: int = 256, eos_share: float = 0.3) -> Workload:
    """Requests sharing document prefixes (local and external hits), some with EOS."""
    rng = random.Random(seed)
    docs = [tuple(rng.randrange(1, 50_000) for _ in range(block_size * rng.randint(*doc_blocks)))
            for _ in range(num_docs)]
    specs = []
    for i in range(num_requests):
        doc = docs[rng.randrange(num_docs)]
        tail = tuple(rng.randrange(1, 50_000) for _ in range(rng.randint(*suffix)))
        specs.append(RequestSpec(f"req-{i:03d}", doc + tail, rng.randint(*max_tokens),
                                 arrival_step=i // max(arrival_every, 1) * 1,
                                 eos=rng.random() < eos_share))
    warm = [docs[i] + (0,) for i in range(min(warm_docs, num_docs))]
    return Workload(specs, warm=warm, store_blocks=store_blocks, load_mode=load_mode,
                    eos_probability=0.05 if eos_share else 0.0)


@dataclass
class RunResult:
    outcomes: dict[str, tuple[str | None, list[int]]]
    pipeline: MetricsPipeline
    steps: int
    engine: object


def _drive(add: Callable[[Request], None], step: Callable[[], object],
           busy: Callable[[], bool], workload: Workload, max_steps: int) -> int:
    pending = sorted(workload.requests, key=lambda s: s.arrival_step)
    steps = 0
    while pending or busy():
        if steps >= max_steps:
            raise RuntimeError(f"workload unfinished after {max_steps} steps")
        while pending and pending[0].arrival_step <= steps:
            add(pending.pop(0).make())
        step()
        steps += 1
    return steps


def _runner(workload: Workload, faults: FaultPlan,
            store: ExternalStoreIndex) -> SimulatedExecutor:
    return SimulatedExecutor(faults, store, eos_probability=workload.eos_probability,
                             async_delay_steps=workload.async_delay_steps)


def run_reference(config: SchedulerConfig, workload: Workload, faults: FaultPlan,
                  max_steps: int = 100_000,
                  make_scheduler: Callable[..., Scheduler] = Scheduler) -> RunResult:
    store = ExternalStoreIndex(workload.store_blocks)
    for tokens in workload.warm:
        probe = Request("warm", ExplicitTokens(tokens), 1)
        probe.update_block_hashes(config.block_size)
        for h in probe.block_hashes:
            store.insert(h)
    scheduler = make_scheduler(config,
                               StoreConnector(store, config.block_size, workload.load_mode))
    loop = EngineLoop(scheduler, _runner(workload, faults, store))
    pipeline = MetricsPipeline(strict=True, engine_kind="reference")
    requests: dict[str, Request] = {}

    def add(request: Request) -> None:
        requests[request.request_id] = request
        scheduler.add_request(request)

    def step() -> None:
        loop.step()
        for events in scheduler.drain_events():
            pipeline.record(events)

    steps = _drive(add, step, loop.busy, workload, max_steps)
    outcomes = {rid: (r.status.finish_reason, list(r.output_token_ids))
                for rid, r in requests.items()}
    return RunResult(outcomes, pipeline, steps, loop)


def run_vllm(config: SchedulerConfig, workload: Workload, faults: FaultPlan,
             max_steps: int = 100_000, **engine_kwargs: Any) -> RunResult:
    from kvmetrics.lab.vllm.engine import VllmEngine

    store = ExternalStoreIndex(workload.store_blocks)
    pipeline = MetricsPipeline(strict=True, engine_kind="vllm")
    engine = VllmEngine(config, _runner(workload, faults, store), store=store,
                        load_mode=workload.load_mode, pipeline=pipeline,
                        recovery=vllm_recovery(config),
                        **engine_kwargs)
    for tokens in workload.warm:
        for h in engine.block_hashes(list(tokens)):
            store.insert(h)
    try:
        steps = _drive(engine.add_request, engine.step, engine.busy, workload, max_steps)
    finally:
        engine.close()
    outcomes = {rid: engine.outcome(rid) for rid in engine.requests}
    return RunResult(outcomes, pipeline, steps, engine)
