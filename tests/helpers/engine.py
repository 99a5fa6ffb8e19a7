"""A reference engine on a test bench: scheduler, store connector, simulated runner, metrics.

``Rig`` drives one step (schedule, execute, update) at a time so a test can look at
the scheduler after each, keeps the last step's outputs, and records a compact trace
of every step (what was scheduled, loaded, preempted and finished) for comparisons.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvmetrics.lab.engine.connector import StoreConnector
from kvmetrics.lab.engine.executor import SimulatedExecutor
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan, ScriptedFailure
from kvmetrics.lab.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.scheduler import Scheduler, SchedulerConfig
from kvmetrics.lab.engine.tokens import ExplicitTokens
from kvmetrics.lab.instrument import InstrumentedEngine
from kvmetrics.metrics.pipeline import MetricsPipeline

BLOCK = 16


def tokens(start: int, n: int) -> list[int]:
    """``n`` distinct token ids from ``start`` (disjoint ranges never share a block)."""
    return list(range(start, start + n))


def make_request(request_id: str, token_ids: Sequence[int], max_tokens: int = 4,
                 cache_salt: str | None = None, eos_token_id: int | None = None) -> Request:
    return Request(request_id, ExplicitTokens(token_ids), max_tokens=max_tokens,
                   cache_salt=cache_salt, eos_token_id=eos_token_id)


def block_hashes(token_ids: Sequence[int], block_size: int = BLOCK) -> list[bytes]:
    """The chained block hashes a request with these prompt tokens gets."""
    probe = make_request("probe", token_ids)
    probe.update_block_hashes(block_size)
    return list(probe.block_hashes)


def fail_block(index: int, request_id: str | None = None, step: int | None = None) -> FaultPlan:
    return FaultPlan(scripted=(ScriptedFailure(index, request_id, step),))


@dataclass(frozen=True)
class StepRecord:
    """What one step decided, in plain values (comparable across runs)."""

    step: int
    scheduled: tuple[tuple[str, int, int], ...]  # (request id, computed before, scheduled)
    block_ids: tuple[tuple[str, tuple[int, ...]], ...]
    loads: tuple[tuple[str, str, int, tuple[int, ...]], ...]
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    invalid_blocks: tuple[int, ...]


@dataclass
class Rig:
    scheduler: Scheduler
    executor: SimulatedExecutor
    store: ExternalStoreIndex
    pipeline: MetricsPipeline | None = None
    instrumented: InstrumentedEngine | None = None
    trace: list[StepRecord] = field(default_factory=list)
    #: Every request added, by id, finished or not.
    requests: dict[str, Request] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    last_out: SchedulerOutput | None = None
    last_result: ModelRunnerOutput | None = None

    @property
    def engine(self) -> Scheduler | InstrumentedEngine:
        return self.instrumented if self.instrumented is not None else self.scheduler

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.engine.add_request(request)
            self.requests[request.request_id] = request

    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.executor.has_pending_work

    def step(self) -> SchedulerOutput:
        engine = self.engine
        out = engine.schedule()
        result = self.executor.execute(out)
        engine.update_from_output(out, result)
        if self.pipeline is not None and self.instrumented is None:
            for events in self.scheduler.drain_events():
                self.pipeline.record(events)
        self.last_out, self.last_result = out, result
        self.trace.append(self._record(out, result))
        return out

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.busy():
            assert steps < max_steps, f"still busy after {max_steps} steps"
            self.step()
            steps += 1
        return steps

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def _record(self, out: SchedulerOutput, result: ModelRunnerOutput) -> StepRecord:
        # Aborts between steps show up in the next step's record.
        now = {rid for rid, r in self.requests.items() if r.is_finished} - self.finished
        self.finished |= now
        return StepRecord(
            step=out.step,
            scheduled=tuple((s.request_id, s.num_computed_tokens, s.num_scheduled_tokens)
                            for s in out.scheduled),
            block_ids=tuple((s.request_id, tuple(s.block_ids)) for s in out.scheduled),
            loads=tuple((ld.request_id, ld.mode, ld.first_index, ld.block_ids)
                        for ld in out.loads),
            preempted=tuple(sorted(out.preempted_req_ids)),
            finished=tuple(sorted(now)),
            invalid_blocks=tuple(sorted(result.invalid_block_ids)),
        )


def build_rig(
    config: SchedulerConfig | None = None,
    *,
    load_mode: str = "sync",
    store_blocks: int = 1024,
    faults: FaultPlan | None = None,
    async_delay_steps: int = 1,
    eos_probability: float = 0.0,
    pipeline: MetricsPipeline | None = None,
    instrument: bool = False,
    connector: bool = True,
    connector_seed: int = 0,
) -> Rig:
    """A scheduler with a store connector, a simulated runner and (optionally) metrics.

    With ``instrument`` the scheduler is wrapped in :class:`InstrumentedEngine`,
    which records into ``pipeline`` itself; without it the rig drains events into
    ``pipeline`` after each step (same result, no wrapper in the loop).
    """
    config = config or SchedulerConfig(block_size=BLOCK)
    store = ExternalStoreIndex(store_blocks)
    conn = (StoreConnector(store, config.block_size, load_mode, seed=connector_seed)
            if connector else None)
    scheduler = Scheduler(config, conn)
    executor = SimulatedExecutor(faults, store, eos_probability=eos_probability,
                                 async_delay_steps=async_delay_steps)
    instrumented = None
    if instrument:
        if pipeline is None:
            raise ValueError("instrument=True needs a pipeline")
        instrumented = InstrumentedEngine(scheduler, pipeline)
    return Rig(scheduler, executor, store, pipeline, instrumented)


def preload(store: ExternalStoreIndex, hashes: Iterable[bytes]) -> None:
    """Put blocks into the external store, as if another instance had saved them."""
    for h in hashes:
        store.insert(h)


def assert_no_leaks(sched: Scheduler) -> None:
    """Once every request has ended, every block is back and nothing is held."""
    pool = sched.pool
    assert pool.num_free_blocks == sched.config.num_gpu_blocks - 1
    assert pool.num_used_blocks == 0
    assert sched.kv.req_blocks == {}
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert not sched.running and not sched.waiting and not sched.kv_holding
    assert sched.requests == {}
