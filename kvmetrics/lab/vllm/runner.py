"""Play vLLM's worker with kvmetrics' model runners.

vLLM's scheduler talks to its workers in ``SchedulerOutput`` deltas (new
requests with their block tables, cached requests with appended or, when
resumed, replaced block ids) and expects a ``ModelRunnerOutput`` back. The
adapter keeps the per-request state a worker keeps (block tables), converts each
step to :class:`kvmetrics.lab.engine.outputs.SchedulerOutput` for any runner with the
``execute(out) -> ModelRunnerOutput`` protocol (the pure ``SimulatedExecutor`` or
the torch data plane), and converts the result back, failed loads included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm.v1.outputs import KVConnectorOutput

from kvmetrics.lab.engine.outputs import (
    BlockSave,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from kvmetrics.lab.vllm.compat import (
    new_request_outputs,
    resumed_req_ids,
    runner_output,
)


class ModelRunner(Protocol):
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput: ...

    @property
    def has_pending_work(self) -> bool: ...


@dataclass
class StepRecord:
    """One step as both sides saw it (tests compare these across engines)."""

    vllm_output: Any
    output: SchedulerOutput
    result: ModelRunnerOutput
    vllm_result: Any


@dataclass
class WorkerState:
    """What a worker remembers between steps: each live request's block table."""

    block_tables: dict[str, list[int]] = field(default_factory=dict)

    def apply(self, out: Any) -> None:
        for rid in out.finished_req_ids:
            self.block_tables.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.block_tables[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        resumed = resumed_req_ids(cached)
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if rid in resumed:
                self.block_tables[rid] = list(ids[0]) if ids is not None else []
            elif ids is not None:
                self.block_tables.setdefault(rid, []).extend(ids[0])


def convert_output(out: Any, step: int, worker: WorkerState, requests: dict[str, Any],
                   block_size: int, has_connector: bool) -> SchedulerOutput:
    """vLLM's scheduler output as the kvmetrics runner protocol expects it.

    ``requests`` is the scheduler's request table, read only for what a real
    worker also has: prompt length and the block hashes of full blocks.
    """
    worker.apply(out)
    before: dict[str, int] = {new.req_id: new.num_computed_tokens
                              for new in out.scheduled_new_reqs}
    outputs: dict[str, int] = {
        new.req_id: new_request_outputs(new, requests[new.req_id].num_prompt_tokens)
        for new in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        before[rid] = cached.num_computed_tokens[i]
        outputs[rid] = cached.num_output_tokens[i]
    result = SchedulerOutput(step=step, finished_req_ids=set(out.finished_req_ids),
                             preempted_req_ids=set(out.preempted_req_ids or ()))
    meta = out.kv_connector_metadata
    result.loads = list(getattr(meta, "loads", ()) or ())
    for rid, n in out.num_scheduled_tokens.items():
        request = requests[rid]
        c = before[rid]
        blocks = worker.block_tables.get(rid, [])
        num_tokens = request.num_prompt_tokens + outputs[rid]
        result.scheduled.append(ScheduledRequest(rid, c, n, list(blocks), num_tokens))
        if has_connector:
            hashes = request.block_hashes
            # Only blocks of known tokens have hashes (an async scheduler may run ahead).
            for idx in range(c // block_size, min((c + n) // block_size, len(hashes))):
                if (idx + 1) * block_size > c:
                    result.saves.append(BlockSave(rid, idx, blocks[idx], hashes[idx]))
    return result


def convert_result(out: Any, result: ModelRunnerOutput) -> Any:
    """A kvmetrics runner's result as vLLM's ``ModelRunnerOutput``."""
    req_ids = list(out.num_scheduled_tokens)
    kv_out = None
    if result.invalid_block_ids or result.finished_recving:
        kv_out = KVConnectorOutput(finished_recving=set(result.finished_recving) or None,
                                   invalid_block_ids=set(result.invalid_block_ids))
    return runner_output(
        req_ids=req_ids,
        sampled_token_ids=[list(result.sampled_token_ids.get(rid, ())) for rid in req_ids],
        kv_connector_output=kv_out,
    )


class VllmRunnerAdapter:
    """Executes vLLM scheduler outputs on a kvmetrics model runner."""

    def __init__(self, runner: ModelRunner, block_size: int) -> None:
        self.runner = runner
        self.block_size = block_size
        self.worker = WorkerState()
        self.step = 0

    @property
    def has_pending_work(self) -> bool:
        return bool(self.runner.has_pending_work)

    def execute(self, out: Any, scheduler: Any, in_flight_steps: int = 0) -> StepRecord:
        """Run one scheduled step; ``in_flight_steps`` earlier steps were scheduled but
        not yet processed when vLLM made this one (1 under its async batch queue)."""
        self.step += 1
        ours = convert_output(out, self.step, self.worker, scheduler.requests, self.block_size,
                              scheduler.connector is not None)
        ours.in_flight_steps = in_flight_steps
        result = self.runner.execute(ours)
        return StepRecord(out, ours, result, convert_result(out, result))

