"""Exact counter values on vLLM's real scheduler for the foundation scenarios.

Every scenario runs vLLM 0.33's scheduler (instrumented) with the built-in store
connector and the pure model runner; the numbers follow from vLLM's recovery
path by hand (block size 16) and each scenario is also run through the reference
engine, which must count the same.
"""

from __future__ import annotations

import logging

import pytest

from kvmetrics.lab.engine.connector import StoreConnector
from kvmetrics.lab.engine.executor import SimulatedExecutor
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan, ScriptedFailure
from kvmetrics.lab.engine.loop import EngineLoop
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.scheduler import Scheduler, SchedulerConfig
from kvmetrics.lab.engine.tokens import ExplicitTokens
from kvmetrics.lab.vllm.engine import VllmEngine
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.metrics import event_totals

pytestmark = pytest.mark.vllm

BS = 16
PROMPT = list(range(1000, 1064))  # 64 tokens, 4 blocks


def config(policy: str = "recompute", blocks: int = 64, **kw: int) -> SchedulerConfig:
    return SchedulerConfig(block_size=BS, num_gpu_blocks=blocks, max_num_seqs=8,
                           max_num_batched_tokens=kw.pop("budget", 256), max_model_len=512,
                           kv_load_failure_policy=policy, **kw)


class Run:
    """One scenario on vLLM, with the per-step view a test needs."""

    def __init__(self, cfg: SchedulerConfig, faults: FaultPlan, warm: list[list[int]],
                 warm_blocks: int | None = None, mode: str = "sync",
                 connector: bool = True) -> None:
        self.store = ExternalStoreIndex(64)
        self.pipeline = MetricsPipeline(strict=True)
        self.engine = VllmEngine(cfg, SimulatedExecutor(faults, self.store),
                                 store=self.store if connector else None,
                                 load_mode=mode, pipeline=self.pipeline, keep_records=True)
        for tokens in warm:
            hashes = self.engine.block_hashes(tokens)
            for h in hashes[:warm_blocks]:
                self.store.insert(h)
        self.computed: list[dict[str, int]] = []

    def add(self, rid: str, tokens: list[int], max_tokens: int = 4) -> None:
        self.engine.add_request(Request(rid, ExplicitTokens(tokens), max_tokens))

    def step(self) -> None:
        self.engine.step()
        self.computed.append({rid: r.num_computed_tokens
                              for rid, r in self.engine.scheduler.requests.items()})

    def run(self) -> None:
        while self.engine.busy():
            self.step()
        self.engine.close()

    def scheduled(self, step: int) -> dict[str, tuple[int, int]]:
        out = self.engine.records[step - 1].output
        return {s.request_id: (s.num_computed_tokens, s.num_scheduled_tokens)
                for s in out.scheduled}

    def total(self, spec: cat.MetricSpec, **labels: str) -> float:
        return self.pipeline.totals.get(spec, **labels)


def reference_totals(cfg: SchedulerConfig, faults: FaultPlan, warm: list[list[int]],
                     requests: list[list[tuple[str, list[int], int]]],
                     warm_blocks: int | None = None, mode: str = "sync",
                     connector: bool = True) -> dict:
    """The same scenario on the reference engine; ``requests`` arrive in waves, one per step."""
    store = ExternalStoreIndex(64)
    for tokens in warm:
        probe = Request("warm", ExplicitTokens(tokens), 1)
        probe.update_block_hashes(BS)
        for h in probe.block_hashes[:warm_blocks]:
            store.insert(h)
    sched = Scheduler(cfg, StoreConnector(store, BS, mode) if connector else None)
    loop = EngineLoop(sched, SimulatedExecutor(faults, store))
    pipeline = MetricsPipeline(strict=True)
    waves = list(requests)
    while waves or loop.busy():
        for rid, tokens, max_tokens in waves.pop(0) if waves else ():
            sched.add_request(Request(rid, ExplicitTokens(tokens), max_tokens))
        loop.step()
        for ev in sched.drain_events():
            pipeline.record(ev)
    return event_totals(pipeline)


def test_sync_load_block_1_fails_recompute(caplog: pytest.LogCaptureFixture) -> None:
    faults = FaultPlan(scripted=(ScriptedFailure(1),))
    run = Run(config(), faults, [PROMPT], warm_blocks=3)
    run.add("r", PROMPT)
    with caplog.at_level(logging.WARNING):
        run.step()
    # vLLM's own log line for this path, for the record.
    assert "1 request(s) rescheduled (32 tokens affected)" in caplog.text
    assert run.scheduled(1) == {"r": (48, 16)}  # 48 external tokens loaded, 16 computed
    assert run.computed[0]["r"] == 16  # 64 -> 16: block #1 and everything after it
    run.step()
    assert run.scheduled(2) == {"r": (16, 48)}
    run.run()
    assert run.total(cat.ROLLED_BACK_TOKENS, mode="sync", policy="recompute") == 32
    assert run.total(cat.RECOMPUTED_TOKENS, cause="kv_load_failure") == 48
    assert run.total(cat.RECOMPUTED_TOKENS, cause="preemption") == 0
    assert run.total(cat.KV_LOAD_BLOCKS, mode="sync", outcome="failed") == 1
    assert run.total(cat.KV_LOAD_BLOCKS, mode="sync", outcome="ok") == 2
    assert run.total(cat.KV_LOAD_FAILED_REQUESTS, mode="sync", policy="recompute",
                     action="rescheduled") == 1
    # External hits are counted when matched, even though one block failed (as vLLM does).
    assert run.total(cat.PREFIX_CACHE_HIT_TOKENS, source="external") == 48
    assert run.total(cat.PROMPT_TOKENS, source="external") == 48
    assert run.total(cat.PROMPT_TOKENS, source="compute") == 16
    assert run.total(cat.EVICTED_BLOCKS) == 0  # recompute keeps the failed blocks hashed
    assert run.engine.outcome("r")[0] == "length"
    assert run.pipeline.violations == []
    assert reference_totals(config(), faults, [PROMPT], [[("r", PROMPT, 4)]], 3) \
        == event_totals(run.pipeline)


def test_sync_load_block_1_fails_fail_policy() -> None:
    faults = FaultPlan(scripted=(ScriptedFailure(1),))
    run = Run(config("fail"), faults, [PROMPT], warm_blocks=3)
    run.add("r", PROMPT)
    run.run()
    assert run.engine.outcome("r") == ("error", [])
    assert run.total(cat.KV_LOAD_FAILED_REQUESTS, mode="sync", policy="fail",
                     action="failed") == 1
    assert run.total(cat.ROLLED_BACK_TOKENS, mode="sync", policy="fail") == 32
    assert run.total(cat.RECOMPUTED_TOKENS) == 0
    assert run.total(cat.FINISHED_REQUESTS, reason="error") == 1
    # Blocks #1..#3 were hashed at allocation; `fail` evicts them.
    assert run.total(cat.EVICTED_BLOCKS, cause="kv_load_failure") == 3
    assert reference_totals(config("fail"), faults, [PROMPT], [[("r", PROMPT, 4)]], 3) \
        == event_totals(run.pipeline)


def test_async_load_block_2_fails() -> None:
    prompt = list(range(2000, 2096))  # 96 tokens: the store can offer 5 blocks = 80 tokens
    faults = FaultPlan(scripted=(ScriptedFailure(2),))
    run = Run(config(), faults, [prompt], mode="async")
    run.add("a", prompt)
    run.step()  # admitted, waiting for the async load of 80 tokens
    assert run.scheduled(1) == {}
    assert run.computed[0]["a"] == 80
    run.step()  # the load reports finished with block #2 failed: back to 32
    assert run.scheduled(2) == {}
    assert run.computed[1]["a"] == 32
    assert run.total(cat.ROLLED_BACK_TOKENS, mode="async", policy="recompute") == 48
    run.step()  # rescheduled from the valid prefix
    assert run.scheduled(3) == {"a": (32, 64)}
    run.run()
    assert run.total(cat.RECOMPUTED_TOKENS, cause="kv_load_failure") == 48
    assert run.total(cat.KV_LOAD_BLOCKS, mode="async", outcome="ok") == 4
    assert run.total(cat.KV_LOAD_BLOCKS, mode="async", outcome="failed") == 1
    assert run.total(cat.KV_LOAD_FAILED_REQUESTS, mode="async", policy="recompute",
                     action="rescheduled") == 1
    assert run.engine.outcome("a")[0] == "length"
    assert reference_totals(config(), faults, [prompt], [[("a", prompt, 4)]], mode="async") \
        == event_totals(run.pipeline)


def test_request_level_async_failure_counts_every_block_of_its_load_failed() -> None:
    """A connector that fails a whole request (``failed_recving``, what vLLM asks of
    connectors whose block ids are not unique) lost all its blocks: 5 failed, none ok.
    vLLM resets the request to 0 computed tokens and it is looked up again: the store
    still holds the blocks, so a second async load of the same 5 blocks succeeds."""
    prompt = list(range(2000, 2096))  # 96 tokens: the store can offer 5 blocks = 80 tokens
    run = Run(config(), FaultPlan(), [prompt], mode="async")
    execute = run.engine.adapter.execute
    failed_once: set[str] = set()

    def fail_whole_request(out: object, scheduler: object, *rest: object):
        record = execute(out, scheduler, *rest)
        kv_out = record.vllm_result.kv_connector_output
        if kv_out is not None and kv_out.finished_recving and not failed_once:
            failed_once.update(kv_out.finished_recving)
            kv_out.failed_recving = set(kv_out.finished_recving)
        return record

    run.engine.adapter.execute = fail_whole_request  # type: ignore[method-assign]
    run.add("a", prompt)
    run.step()  # admitted, waiting for the async load of 80 tokens
    run.step()  # the transfer reports finished, and the request failed as a whole
    assert failed_once == {"a"}
    assert run.computed[1]["a"] == 0
    assert run.total(cat.KV_LOAD_BLOCKS, mode="async", outcome="failed") == 5
    assert run.total(cat.KV_LOAD_BLOCKS, mode="async", outcome="ok") == 0
    assert run.total(cat.ROLLED_BACK_TOKENS, mode="async", policy="recompute") == 80
    assert run.total(cat.KV_LOAD_FAILED_REQUESTS, mode="async", policy="recompute",
                     action="rescheduled") == 1
    run.run()
    assert run.engine.outcome("a")[0] == "length"
    assert run.total(cat.KV_LOAD_BLOCKS, mode="async", outcome="failed") == 5
    assert run.total(cat.KV_LOAD_BLOCKS, mode="async", outcome="ok") == 5
    assert run.total(cat.PREFIX_CACHE_QUERY_TOKENS, source="external", admission="repeat") == 96


def test_failed_block_shared_by_two_requests_is_recomputed_by_one() -> None:
    other = PROMPT[:48] + list(range(5000, 5016))
    faults = FaultPlan(scripted=(ScriptedFailure(1, request_id="a"),))
    run = Run(config(), faults, [PROMPT], warm_blocks=3)
    run.add("a", PROMPT)
    run.add("b", other)  # admitted in the same step: a local hit on a's 3 fresh blocks
    run.step()
    assert run.scheduled(1) == {"a": (48, 16), "b": (48, 16)}
    assert run.computed[0] == {"a": 16, "b": 48}  # only a owns (and recomputes) block #1
    run.step()
    assert run.scheduled(2) == {"a": (16, 48), "b": (48, 16)}
    run.run()
    assert run.total(cat.KV_LOAD_FAILED_REQUESTS, action="rescheduled") == 2
    assert run.total(cat.ROLLED_BACK_TOKENS) == 32  # b only falls back to its pre-step count
    # a recomputes 48; b only recomputes the 16 tokens whose output was discarded.
    assert run.total(cat.RECOMPUTED_TOKENS, cause="kv_load_failure") == 64
    assert run.total(cat.PREFIX_CACHE_HIT_TOKENS, source="local") == 48
    assert reference_totals(config(), faults, [PROMPT],
                            [[("a", PROMPT, 4), ("b", other, 4)]], 3) \
        == event_totals(run.pipeline)


def test_preemption_after_a_partial_hit() -> None:
    doc = list(range(3000, 3032))  # 2 blocks, cached locally by a first request
    first = doc + [7]
    short = list(range(4000, 4040))  # 40 tokens, admitted first
    partial = doc + list(range(6000, 6024))  # 56 tokens: a 32-token local hit
    cfg = config(blocks=8)  # 7 usable blocks
    run = Run(cfg, FaultPlan(), [], connector=False)
    run.add("w", first, max_tokens=1)
    run.step()
    run.add("s", short, max_tokens=20)
    run.add("p", partial, max_tokens=20)
    run.step()
    assert run.scheduled(2) == {"s": (0, 40), "p": (32, 24)}
    run.run()
    assert run.total(cat.PREEMPTIONS) == 1
    assert run.total(cat.PREFIX_CACHE_QUERY_TOKENS, source="local", admission="first") \
        == 33 + 40 + 56
    assert run.total(cat.PREFIX_CACHE_HIT_TOKENS, source="local", admission="first") == 32
    # s's growth preempts p (64 of its 65 tokens computed) at step 11; when s is done,
    # p comes back with a 48-token hit on its own freed blocks (the 4th was reused by
    # s) and schedules 17 tokens, 16 of which it had computed before.
    assert run.scheduled(10) == {"s": (47, 1), "p": (63, 1)}
    assert run.scheduled(11) == {"s": (48, 1)}
    assert run.engine.records[10].output.preempted_req_ids == {"p"}
    assert run.scheduled(22) == {"p": (48, 17)}
    assert run.total(cat.PREFIX_CACHE_QUERY_TOKENS, source="local", admission="repeat") == 65
    assert run.total(cat.PREFIX_CACHE_HIT_TOKENS, source="local", admission="repeat") == 48
    assert run.total(cat.RECOMPUTED_TOKENS, cause="preemption") == 16
    assert run.total(cat.EVICTED_BLOCKS, cause="capacity") == 2
    assert run.total(cat.RECOMPUTED_TOKENS, cause="kv_load_failure") == 0
    assert run.total(cat.PROMPT_TOKENS, source="local_cache") == 32
    assert run.engine.outcome("p")[0] == "length"
    assert len(run.engine.outcome("p")[1]) == 20
    assert run.pipeline.violations == []
    assert reference_totals(cfg, FaultPlan(), [], [[("w", first, 1)], [("s", short, 20),
                            ("p", partial, 20)]], connector=False) \
        == event_totals(run.pipeline)


def test_async_scheduler_keeps_the_discarded_steps_placeholder() -> None:
    """vLLM's AsyncScheduler after a failed sync load (docs/vllm-defects.md).

    The failed step was the request's last prefill chunk, so ``_update_after_schedule``
    added an output placeholder; the recovery path discards that step's output
    before ``_update_request_with_output`` would resolve it, and nothing resets it.
    The request is then scheduled one token past what it knows, for good.
    """
    from kvmetrics.lab.vllm import builder

    store = ExternalStoreIndex(64)
    engine = VllmEngine(config(), SimulatedExecutor(FaultPlan(scripted=(ScriptedFailure(1),)),
                                                    store),
                        store=store, scheduler_cls=builder.INSTRUMENTED_ASYNC,
                        keep_records=True)
    for h in engine.block_hashes(PROMPT)[:3]:
        store.insert(h)
    engine.add_request(Request("r", ExplicitTokens(PROMPT), 4))
    request = engine.scheduler.requests["r"]
    engine.step()
    assert (request.num_computed_tokens, request.num_output_placeholders) == (16, 1)
    engine.step()
    # 48 tokens to recompute, plus one for a token that was never kept.
    assert engine.records[-1].vllm_output.num_scheduled_tokens == {"r": 49}
    assert request.num_output_placeholders == 1
    assert request.num_computed_tokens == request.num_tokens == 65
    engine.close()
