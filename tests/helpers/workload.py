"""Random workloads for the reference engine: shared prefixes, arrivals, aborts, faults.

Plain data plus one driver, so hypothesis strategies and seeded ``random`` runs
build the same kind of workload and the same driver replays it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvmetrics.lab.engine.executor import EOS_TOKEN_ID
from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.engine import Rig, block_hashes, build_rig, make_request, preload


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prefix: int  # index of a shared prefix (-1: none)
    prefix_len: int
    suffix_len: int
    max_tokens: int
    arrival_step: int
    abort_step: int | None = None

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.suffix_len


@dataclass(frozen=True)
class Workload:
    block_size: int
    num_gpu_blocks: int
    max_num_batched_tokens: int
    policy: str
    load_mode: str
    fault_rate: float
    fault_seed: int
    async_delay_steps: int
    #: Shared prefixes whose first blocks are already in the external store.
    stored_prefix_blocks: tuple[int, ...]
    requests: tuple[RequestSpec, ...]
    accounting: str = "unified"
    store_blocks: int = 64
    max_num_seqs: int = 16
    prefix_caching: bool = True
    eos_probability: float = 0.0
    prefixes: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    def config(self) -> SchedulerConfig:
        return SchedulerConfig(
            block_size=self.block_size, num_gpu_blocks=self.num_gpu_blocks,
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            max_model_len=4096, enable_prefix_caching=self.prefix_caching,
            kv_load_failure_policy=self.policy, accounting=self.accounting)

    def prompt(self, spec: RequestSpec) -> list[int]:
        # Suffix tokens are unique per request (ids from 10**6 up, by request index).
        head = list(self.prefixes[spec.prefix][: spec.prefix_len]) if spec.prefix >= 0 else []
        base = 1_000_000 + 10_000 * int(spec.request_id.removeprefix("r"))
        return head + list(range(base, base + spec.suffix_len))


def _blocks(workload: Workload, spec: RequestSpec) -> int:
    """Blocks a request holds at its longest (its last sampled token is never computed)."""
    return -(-(spec.prompt_len + spec.max_tokens - 1) // workload.block_size)


def ensure_progress(workload: Workload) -> Workload:
    """Grow the cache just enough for the largest request on its own (the scheduler
    refuses a request that could never fit). Caches stay small otherwise, so
    preemption and async-admission pressure stay in the mix."""
    need = max(_blocks(workload, s) for s in workload.requests) + 1
    if workload.num_gpu_blocks >= need:
        return workload
    return replace(workload, num_gpu_blocks=need)


def prefix_tokens(n_prefixes: int, length: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(range(100_000 * (p + 1), 100_000 * (p + 1) + length))
                 for p in range(n_prefixes))


def random_workload(rng: random.Random, n_requests: int = 12, arrival_span: int = 20,
                    **overrides: object) -> Workload:
    """A seeded workload in the same space as the hypothesis strategy; ``overrides``
    replace any drawn :class:`Workload` field."""
    block_size = overrides.pop("block_size", rng.choice((4, 8, 16)))
    num_gpu_blocks = overrides.pop("num_gpu_blocks", rng.randint(12, 40))
    prefixes = prefix_tokens(3, 6 * block_size)
    specs = []
    for i in range(n_requests):
        prefix = rng.randint(-1, 2)
        max_tokens = rng.randint(1, 24)
        prefix_len = rng.randint(0, 6 * block_size) if prefix >= 0 else 0
        suffix_len = rng.randint(1, 5 * block_size)
        arrival = rng.randint(0, arrival_span)
        abort = arrival + rng.randint(0, 40) if rng.random() < 0.15 else None
        specs.append(RequestSpec(f"r{i}", prefix, prefix_len, suffix_len, max_tokens,
                                 arrival, abort))
    fields = dict(
        block_size=block_size, num_gpu_blocks=num_gpu_blocks,
        max_num_batched_tokens=rng.choice((block_size * 2, 48, 96, 256)),
        policy=rng.choice(("recompute", "fail")),
        load_mode=rng.choice(("sync", "async", "mixed")),
        fault_rate=rng.choice((0.0, 0.1, 0.3, 0.6)), fault_seed=rng.randint(0, 1000),
        async_delay_steps=rng.randint(0, 2),
        stored_prefix_blocks=tuple(rng.randint(0, 6) for _ in prefixes),
        requests=tuple(specs), prefixes=prefixes,
    )
    fields.update(overrides)
    return ensure_progress(Workload(**fields))  # type: ignore[arg-type]


def rig_for(workload: Workload, pipeline: MetricsPipeline | None = None,
            instrument: bool = False) -> Rig:
    rig = build_rig(workload.config(), load_mode=workload.load_mode,
                    store_blocks=workload.store_blocks,
                    faults=FaultPlan(rate=workload.fault_rate, seed=workload.fault_seed),
                    async_delay_steps=workload.async_delay_steps,
                    eos_probability=workload.eos_probability, pipeline=pipeline,
                    instrument=instrument)
    for prefix, n_blocks in zip(workload.prefixes, workload.stored_prefix_blocks, strict=True):
        preload(rig.store, block_hashes(prefix, workload.block_size)[:n_blocks])
    return rig


def drive(workload: Workload, rig: Rig, max_steps: int = 5_000,
          after_step: Callable[[Rig], None] | None = None) -> int:
    """Replay arrivals and aborts step by step until every request has ended."""
    pending = sorted(workload.requests, key=lambda s: (s.arrival_step, s.request_id))
    aborts = sorted((s.abort_step, s.request_id) for s in workload.requests
                    if s.abort_step is not None)
    step = 0
    unreported_abort = False
    while pending or rig.busy():
        assert step < max_steps, f"workload still running after {max_steps} steps"
        while pending and pending[0].arrival_step <= step:
            spec = pending.pop(0)
            eos = EOS_TOKEN_ID if workload.eos_probability else None
            rig.add(make_request(spec.request_id, workload.prompt(spec), spec.max_tokens,
                                 eos_token_id=eos))
        while aborts and aborts[0][0] <= step:
            _, rid = aborts.pop(0)
            if rid in rig.requests:
                unreported_abort |= rig.abort(rid)
        if rig.busy() or unreported_abort:
            # An abort between steps is reported with the next step, so a run that
            # ends with an abort takes one more (empty) step to report it.
            rig.step()
            unreported_abort = False
            if after_step is not None:
                after_step(rig)
        step += 1
    return step

