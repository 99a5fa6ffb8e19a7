"""A small harness that wires the reference engine to a runner and drives a workload.

Tests and ``benchmarks/bench_dataplane.py`` use it to build the same engine with
either the torch data plane or the tensor-less executor, feed requests at given
steps (with aborts), and record what was scheduled and what came out, so that
two runs can be compared field by field.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvmetrics.lab.engine.connector import StoreConnector
from kvmetrics.lab.engine.executor import EOS_TOKEN_ID, SimulatedExecutor
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.loop import EngineLoop
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.scheduler import Scheduler, SchedulerConfig
from kvmetrics.lab.engine.tokens import VOCAB_SIZE, ExplicitTokens
from kvmetrics.lab.kv.runner import TorchModelRunner


@dataclass
class Engine:
    scheduler: Scheduler
    runner: Any  # TorchModelRunner | SimulatedExecutor
    loop: EngineLoop
    store: ExternalStoreIndex | None


def build_engine(
    *,
    runner: str = "torch",
    block_size: int = 4,
    num_gpu_blocks: int = 64,
    max_num_batched_tokens: int = 32,
    max_num_seqs: int = 8,
    max_model_len: int = 1024,
    policy: str = "recompute",
    load_mode: str = "sync",
    store_blocks: int = 256,
    faults: FaultPlan | None = None,
    seed: int = 0,
    eos_probability: float = 0.0,
    async_delay_steps: int = 1,
    scheduler_cls: type[Scheduler] = Scheduler,
    recovery: str = "vllm",
    **torch_options: Any,
) -> Engine:
    """The reference engine with a store connector (``store_blocks=0``: none) and a runner."""
    config = SchedulerConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                             max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, kv_load_failure_policy=policy,
                             recovery=recovery)
    store = ExternalStoreIndex(store_blocks) if store_blocks else None
    connector = (StoreConnector(store, block_size, load_mode, seed)
                 if store is not None else None)
    scheduler = scheduler_cls(config, connector)
    faults = faults or FaultPlan()
    if runner == "torch":
        requests = scheduler.requests
        model: Any = TorchModelRunner(
            block_size=block_size, num_gpu_blocks=num_gpu_blocks, store=store, faults=faults,
            tokens=lambda rid, start, end: requests[rid].token_ids(start, end),
            seed=seed, eos_probability=eos_probability, async_delay_steps=async_delay_steps,
            **torch_options)
    elif runner == "simulated":
        model = SimulatedExecutor(faults, store, eos_probability=eos_probability,
                                  async_delay_steps=async_delay_steps)
    else:
        raise ValueError(f"runner must be 'torch' or 'simulated', got {runner!r}")
    return Engine(scheduler, model, EngineLoop(scheduler, model), store)


@dataclass(frozen=True)
class Job:
    """A request to add at step ``arrival`` (and abort at step ``abort_at``, if given)."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int = 0
    abort_at: int | None = None
    stop_on_eos: bool = False

    def request(self) -> Request:
        return Request(self.request_id, ExplicitTokens(self.prompt), self.max_tokens,
                       eos_token_id=EOS_TOKEN_ID if self.stop_on_eos else None)


@dataclass
class Trace:
    #: Per step: (request id, computed before, scheduled) of every scheduled request.
    schedule: list[tuple[tuple[str, int, int], ...]] = field(default_factory=list)
    #: Per request: (output token ids, finish reason).
    outputs: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)


def drive(engine: Engine, jobs: list[Job], max_steps: int = 5000) -> Trace:
    """Run jobs to completion, adding and aborting them at their steps."""
    trace = Trace()
    made = {job.request_id: job.request() for job in jobs}
    pending = sorted(jobs, key=lambda j: j.arrival)
    step = 0
    while pending or engine.loop.busy():
        if step >= max_steps:
            raise RuntimeError(f"workload unfinished after {max_steps} steps")
        while pending and pending[0].arrival <= step:
            engine.scheduler.add_request(made[pending.pop(0).request_id])
        for job in jobs:
            if job.abort_at == step:
                engine.scheduler.abort(job.request_id)
        if engine.loop.busy():
            out = engine.loop.step()
            trace.schedule.append(tuple((s.request_id, s.num_computed_tokens,
                                         s.num_scheduled_tokens) for s in out.scheduled))
        step += 1
    for rid, request in made.items():
        trace.outputs[rid] = (tuple(request.output_token_ids), request.status.value)
    return trace


def shared_prefix_jobs(seed: int, n: int, *, n_prefixes: int = 3, prefix_len: int = 24,
                       suffix_len: tuple[int, int] = (1, 12), max_tokens: tuple[int, int] = (1, 8),
                       spread: int = 6, abort_rate: float = 0.0,
                       eos_rate: float = 0.0) -> list[Job]:
    """Requests that share a few long prefixes (so the prefix cache and the store both
    matter), with random suffixes, arrivals within ``spread`` steps and optional aborts."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(VOCAB_SIZE) for _ in range(prefix_len))
                for _ in range(n_prefixes)]
    jobs = []
    for i in range(n):
        suffix = tuple(rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(*suffix_len)))
        arrival = rng.randrange(spread) if spread else 0
        abort_at = arrival + rng.randint(0, 6) if rng.random() < abort_rate else None
        jobs.append(Job(f"r{i}", rng.choice(prefixes) + suffix, rng.randint(*max_tokens),
                        arrival, abort_at, stop_on_eos=rng.random() < eos_rate))
    return jobs


def populate_store(engine: Engine, prompt: tuple[int, ...], request_id: str = "seed") -> None:
    """Run one request to completion (its full blocks are saved to the store), then
    forget the prefix cache, so that later requests sharing its prefix load from the store."""
    drive(engine, [Job(request_id, prompt, 1)])
    if not engine.scheduler.reset_prefix_cache():
        raise RuntimeError("prefix cache reset refused: a request still holds blocks")


