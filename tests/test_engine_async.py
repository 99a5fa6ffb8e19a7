"""The reference engine under async scheduling and vLLM's admission defaults.

Each test is a hand-worked example of vLLM 0.33's behaviour (docs/vllm-research.md,
"Async scheduling"): the batch queue of two, placeholders, deferred block frees
with a connector, victims that cannot be preempted while in flight, stale output
after a preemption, the rollback of a step in flight (both modes), the admission
gate on the whole prompt and the chunk limit. Exact equality with vLLM's real
scheduler is checked by tests/test_vllm_differential.py; these pin the reasons.
"""

from __future__ import annotations

from dataclasses import replace

from kvmetrics.lab.engine.connector import StoreConnector
from kvmetrics.lab.engine.executor import SimulatedExecutor
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.loop import EngineLoop
from kvmetrics.lab.engine.outputs import SchedulerOutput
from kvmetrics.lab.engine.request import Request, RequestStatus
from kvmetrics.lab.engine.scheduler import Scheduler, SchedulerConfig
from kvmetrics.metrics import catalogue as cat
from tests.helpers.engine import block_hashes, fail_block, make_request, preload
from tests.helpers.engine import tokens as token_range

BS = 16


class Bench:
    """A scheduler, a simulated runner and the engine loop, with every step kept."""

    def __init__(self, config: SchedulerConfig, *, store_blocks: int = 0,
                 faults: FaultPlan | None = None, eos_probability: float = 0.0) -> None:
        self.store = ExternalStoreIndex(store_blocks) if store_blocks else None
        connector = (StoreConnector(self.store, config.block_size)
                     if self.store is not None else None)
        self.scheduler = Scheduler(config, connector)
        self.runner = SimulatedExecutor(faults, self.store, eos_probability=eos_probability)
        self.loop = EngineLoop(self.scheduler, self.runner)
        self.outputs: list[SchedulerOutput] = []
        #: Every request added, finished or not (the scheduler forgets finished ones).
        self.added: list[Request] = []

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)
            self.added.append(request)

    def step(self) -> SchedulerOutput:
        out = self.loop.step()
        self.outputs.append(out)
        return out

    def run(self, max_steps: int = 500) -> int:
        steps = 0
        while self.loop.busy():
            assert steps < max_steps
            self.step()
            steps += 1
        return steps

    def scheduled(self) -> list[dict[str, int]]:
        return [out.num_scheduled_tokens for out in self.outputs if out.scheduled]

    def totals(self) -> dict[tuple[str, tuple[str, ...]], float]:
        from kvmetrics.metrics.pipeline import MetricsPipeline

        pipeline = MetricsPipeline(strict=True)
        for events in self.scheduler.drain_events():
            pipeline.record(events)
        return pipeline.totals.series()


def config(**kw: object) -> SchedulerConfig:
    base = SchedulerConfig(block_size=BS, num_gpu_blocks=64, max_num_seqs=8,
                           max_num_batched_tokens=256, max_model_len=1024)
    return replace(base, **kw)  # type: ignore[arg-type]


def test_batch_queue_schedules_the_next_step_before_the_output_and_never_overshoots() -> None:
    """32-token prompt, 4 outputs. Lockstep: 4 steps (prefill, 3 decodes). Async: the same
    4 scheduled steps, each decode scheduled while the previous output is unknown (a
    placeholder); the step that would sample a 5th token is not scheduled, and three
    calls only drain the queue. Tokens are the same either way."""
    runs = {}
    for mode in (False, True):
        bench = Bench(config(async_scheduling=mode))
        r = make_request("r", token_range(0, 32), max_tokens=4)
        bench.add(r)
        runs[mode] = (bench.run(), bench.scheduled(), list(r.output_token_ids), r)
    (sync_steps, sync_sched, sync_out, _), (async_steps, async_sched, async_out, r) = \
        runs[False], runs[True]
    assert sync_sched == async_sched == [{"r": 32}, {"r": 1}, {"r": 1}, {"r": 1}]
    assert (sync_steps, async_steps) == (4, 7)
    assert async_out == sync_out and len(async_out) == 4
    assert r.num_output_placeholders == 0 and r.num_in_flight_tokens == 0


def test_a_placeholder_lets_the_decode_run_before_the_token_is_known() -> None:
    bench = Bench(config(async_scheduling=True))
    r = make_request("r", token_range(0, 32), max_tokens=4)
    bench.add(r)
    bench.step()  # prefill scheduled and executed, output not processed yet
    assert (r.num_computed_tokens, r.num_output_placeholders, r.output_token_ids) == (32, 1, [])
    out = bench.step()  # the decode of position 32 is scheduled; the prefill's output lands
    assert out.num_scheduled_tokens == {"r": 1}
    assert out.scheduled[0].num_tokens == 33  # the runner knows the token it sampled
    assert (r.num_computed_tokens, r.num_output_placeholders, len(r.output_token_ids)) \
        == (33, 1, 1)


def _eos_at_first_token(store_blocks: int) -> tuple[Bench, Request]:
    bench = Bench(config(async_scheduling=True, num_gpu_blocks=8), store_blocks=store_blocks,
                  eos_probability=1.0)
    r = make_request("r", token_range(0, 40), max_tokens=8, eos_token_id=50_000)
    bench.add(r)
    return bench, r


def test_with_a_connector_a_finished_requests_blocks_return_a_step_late() -> None:
    """vLLM's defer_block_free: r stops (EOS) in the output of step 1 while step 2,
    which still writes r's blocks, is in flight; its 3 blocks stay out of the pool
    until step 2's output has been processed."""
    bench, r = _eos_at_first_token(store_blocks=64)
    bench.step()
    bench.step()  # step 2 scheduled (a decode of r), step 1's output: EOS
    assert r.status is RequestStatus.FINISHED_STOPPED
    pool = bench.scheduler.pool
    assert "r" not in bench.scheduler.requests and bench.scheduler.kv.req_blocks == {}
    assert pool.num_free_blocks == 7 - 3 and len(bench.scheduler.deferred_frees) == 1
    bench.step()  # step 2's output processed: the fence has passed
    assert pool.num_free_blocks == 7 and not bench.scheduler.deferred_frees


def test_without_a_connector_the_blocks_return_at_once() -> None:
    bench, r = _eos_at_first_token(store_blocks=0)
    bench.step()
    bench.step()
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert bench.scheduler.pool.num_free_blocks == 7 and not bench.scheduler.defer_block_free


def _crowded(async_scheduling: bool, store_blocks: int) -> Bench:
    """5 usable blocks of 16: a (30 tokens, 2 blocks) and b (40 tokens, 3 blocks) fill
    them; a's decode of position 32 needs a third block of its own."""
    bench = Bench(config(async_scheduling=async_scheduling, num_gpu_blocks=6),
                  store_blocks=store_blocks)
    bench.add(make_request("a", token_range(0, 30), max_tokens=8),
              make_request("b", token_range(100, 40), max_tokens=8))
    return bench


def _first_preemption(bench: Bench) -> tuple[int, set[str]]:
    for i in range(20):
        out = bench.step()
        if out.preempted_req_ids:
            return i, out.preempted_req_ids
    raise AssertionError("nobody was preempted in 20 steps")


def test_a_victim_still_in_flight_is_not_preempted_with_a_connector() -> None:
    """In lockstep b (the latest) is preempted in the 4th step, when a decodes
    position 32. Under async scheduling with a connector b's decode of the step still
    in flight may write its blocks, so they cannot be freed now: a waits, and b is
    preempted once that step is processed. Without a connector nothing is deferred:
    b goes in the same step as in lockstep."""
    assert _first_preemption(_crowded(False, store_blocks=64)) == (3, {"b"})
    step, victims = _first_preemption(_crowded(True, store_blocks=64))
    assert victims == {"b"} and step > 3
    assert _first_preemption(_crowded(True, store_blocks=0)) == (3, {"b"})


def test_without_a_connector_a_preempted_requests_output_in_flight_is_still_delivered() -> None:
    """No connector, no deferred frees: b is preempted while its decode of position 42
    is in flight. The token that step sampled is appended when its output comes back
    (vLLM's stale output, in the same call here), without touching the counts the
    preemption reset; b later resumes and both end with the tokens of lockstep."""
    bench = _crowded(True, store_blocks=0)
    _first_preemption(bench)
    b = bench.scheduler.requests["b"]
    assert b.status is RequestStatus.PREEMPTED
    assert (b.num_computed_tokens, b.num_output_placeholders, b.num_stale_output_tokens) \
        == (0, 0, 0)
    assert len(b.output_token_ids) == 3  # positions 40, 41 and the stale 42
    bench.run()
    lockstep = _crowded(False, store_blocks=0)
    lockstep.run()
    for rid in ("a", "b"):
        ours = next(r for r in bench.added if r.request_id == rid)
        theirs = next(r for r in lockstep.added if r.request_id == rid)
        assert ours.output_token_ids == theirs.output_token_ids and len(ours.output_token_ids) == 8


PROMPT = token_range(1_000, 64)


def _failed_load(rollback: str) -> tuple[Bench, Request]:
    """r loads 48 tokens synchronously and its block #1 fails (the sync_failure
    scenario), under async scheduling."""
    bench = Bench(config(async_scheduling=True, async_rollback=rollback), store_blocks=64,
                  faults=fail_block(1, "r"))
    preload(bench.store, block_hashes(PROMPT)[:3])
    r = make_request("r", PROMPT, max_tokens=4)
    bench.add(r)
    return bench, r


def test_the_rollback_counts_the_step_in_flight() -> None:
    """Step 1 computes 48..64; step 2 (a decode of 64) is in flight when step 1's
    output reports block #1 failed. 65 computed minus step 1's 16 is 49 before the
    step; truncated to 16: 33 tokens rolled back (vLLM logs '33 tokens affected')."""
    bench, r = _failed_load("vllm")
    bench.step()
    bench.step()
    assert r.num_computed_tokens == 16
    assert bench.totals()[(cat.ROLLED_BACK_TOKENS.name, ("sync", "recompute"))] == 33


def test_vllm_rollback_keeps_the_step_in_flight_and_runs_one_token_ahead() -> None:
    """async_rollback="vllm" (vLLM 0.33, upstream #45138): the placeholder stays and
    step 2's token (sampled over the failed block) is kept as r's first output, so r
    is rescheduled one token past what it knows and its output is shifted."""
    clean = Bench(config(), store_blocks=64)
    preload(clean.store, block_hashes(PROMPT)[:3])
    reference = make_request("r", PROMPT, max_tokens=4)
    clean.add(reference)
    clean.run()

    bench, r = _failed_load("vllm")
    bench.step()
    bench.step()
    assert r.num_output_placeholders == 2
    out = bench.step()  # scheduled before step 2's output: 65 known + 1 placeholder - 16
    assert out.num_scheduled_tokens == {"r": 50}
    bench.run()
    assert len(r.output_token_ids) == 4
    assert r.output_token_ids == reference.output_token_ids[1:] + [r.output_token_ids[-1]]
    assert r.output_token_ids != reference.output_token_ids


def test_drop_rollback_discards_the_step_in_flight_and_matches_a_clean_run() -> None:
    bench, r = _failed_load("drop")
    bench.step()
    bench.step()
    assert (r.num_output_placeholders, r.num_stale_output_tokens, r.drop_stale_output) \
        == (0, 1, True)
    out = bench.step()  # step 2's output (stale) is dropped; 48 tokens to recompute
    assert out.num_scheduled_tokens == {"r": 48} and r.output_token_ids == []
    bench.run()
    clean = Bench(config(), store_blocks=64)
    preload(clean.store, block_hashes(PROMPT)[:3])
    reference = make_request("r", PROMPT, max_tokens=4)
    clean.add(reference)
    clean.run()
    assert r.output_token_ids == reference.output_token_ids


def test_the_whole_prompt_must_fit_to_be_admitted() -> None:
    """5 usable blocks; a (40 tokens) takes 3. x (48 tokens, 3 blocks) fits its first
    16-token chunk in the 2 free blocks but not its whole prompt: vLLM's default
    (scheduler_reserve_full_isl) keeps it waiting, the old admission starts it."""
    admitted = {}
    for gate in (True, False):
        bench = Bench(config(num_gpu_blocks=6, max_num_batched_tokens=56,
                             reserve_full_prompt=gate))
        bench.add(make_request("a", token_range(0, 40), max_tokens=8),
                  make_request("x", token_range(500, 48), max_tokens=1))
        admitted[gate] = bench.step().num_scheduled_tokens
    assert admitted[True] == {"a": 40}
    assert admitted[False] == {"a": 40, "x": 16}


def test_a_chunk_limit_applies_only_while_others_wait() -> None:
    alone = Bench(config(long_prefill_token_threshold=16))
    alone.add(make_request("a", token_range(0, 64), max_tokens=1))
    assert alone.step().num_scheduled_tokens == {"a": 64}
    pair = Bench(config(long_prefill_token_threshold=16))
    pair.add(make_request("a", token_range(0, 64), max_tokens=1),
             make_request("b", token_range(500, 64), max_tokens=1))
    assert pair.step().num_scheduled_tokens == {"a": 16, "b": 16}


def test_a_request_aborted_while_its_failing_step_runs_leaves_the_block_hashed() -> None:
    """docs/vllm-defects.md ``aborted-owner-keeps-failed-block``: r is aborted after
    step 1 (its sync load) was scheduled and before its output is processed, which
    under async scheduling is where every abort lands. The recovery path only scans
    requests still scheduled, so with vLLM's path the failed block stays hashed, under
    ``fail`` too; the fix evicts r's blocks from the failed one on."""
    for recovery, hashed in (("vllm", True), ("evict", False)):
        bench = Bench(config(async_scheduling=True, kv_load_failure_policy="fail",
                             recovery=recovery), store_blocks=64, faults=fail_block(1, "r"))
        preload(bench.store, block_hashes(PROMPT)[:3])
        r = make_request("r", PROMPT, max_tokens=4)
        bench.add(r)
        out = bench.step()
        failed = out.loads[0].block_ids[1]
        assert bench.scheduler.abort("r")
        bench.step()  # step 1's output: the load of block #1 failed
        assert (bench.scheduler.pool.blocks[failed].block_hash is not None) is hashed
        assert bench.scheduler.finished_in_flight == {}
