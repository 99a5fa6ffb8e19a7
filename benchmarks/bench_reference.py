"""Reference engine: instrumentation overhead, and recovery-path scaling."""

from __future__ import annotations

import gc
import random
import time

from benchmarks.common import Row, best_time, interleaved_ratio
from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.lab.engine.executor import SimulatedExecutor
from kvmetrics.lab.engine.loop import EngineLoop
from kvmetrics.lab.engine.recovery import handle_invalid_blocks
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.scheduler import Scheduler, SchedulerConfig
from kvmetrics.lab.engine.tokens import ExplicitTokens
from kvmetrics.lab.instrument import InstrumentedEngine
from kvmetrics.metrics.events import StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline

PROMPT = 64


def _running_scheduler(num_requests: int, num_blocks: int, block_size: int = 16,
                       policy: str = "recompute") -> Scheduler:
    """A scheduler whose ``num_requests`` requests have all finished prefill and decode."""
    cfg = SchedulerConfig(block_size=block_size, num_gpu_blocks=num_blocks,
                          max_num_seqs=num_requests,
                          max_num_batched_tokens=max(PROMPT * num_requests, 2048),
                          max_model_len=1_000_000, kv_load_failure_policy=policy)
    sched = Scheduler(cfg)
    # Long enough never to finish during a benchmark, short enough to fit the cache.
    max_tokens = min((num_blocks - 1) * block_size, cfg.max_model_len) - PROMPT
    rng = random.Random(num_requests)
    for i in range(num_requests):
        sched.add_request(Request(f"r{i}", ExplicitTokens(
            [rng.randrange(1, 50_000) for _ in range(PROMPT)]), max_tokens=max_tokens))
    loop = EngineLoop(sched, SimulatedExecutor())
    loop.step()
    sched.drain_events()
    return sched


def _overhead(num_requests: int, steps: int, rounds: int) -> Row:
    """Alternate chunks of steps on ONE engine with and without the metrics pipeline.

    Using the same engine for both sides keeps memory layout and request state
    identical, so the ratio isolates what instrumentation adds to a step.
    """
    blocks = num_requests * ((PROMPT + steps * (rounds * 2 + 2)) // 16 + 2) + 2
    sched = _running_scheduler(num_requests, blocks)
    loop = EngineLoop(sched, SimulatedExecutor())
    instrumented = InstrumentedEngine(sched, MetricsPipeline([PrometheusSink()]))

    def run_bare() -> None:
        for _ in range(steps):
            loop.step()
            sched.drain_events()  # the engine records events either way

    metrics_seconds = [0.0]

    def run_wrapped() -> None:
        for _ in range(steps):
            loop.step()
            start = time.perf_counter()
            instrumented.flush()
            metrics_seconds[0] += time.perf_counter() - start

    gc.disable()
    try:
        tw, tb, ratio = interleaved_ratio(run_wrapped, run_bare, rounds=rounds)
    finally:
        gc.enable()
    # The same cost measured directly (less noisy than a ratio of two step times).
    per_step = metrics_seconds[0] / (steps * rounds)
    return [
        Row("instrumentation overhead (reference)", f"{num_requests} running",
            ratio, "x wrapped/bare", "<= 1.03x", ratio <= 1.03),
        Row("instrumentation cost per step (reference)", f"{num_requests} running",
            per_step * 1e6, f"us ({per_step / (tb / steps):.1%} of a step)"),
    ]


def _recovery_time(sched: Scheduler, k: int) -> float:
    """Seconds to run the recovery path for ``k`` failed blocks (one per request)."""
    running = sched.running[:k]
    invalid = {sched.kv.req_blocks[r.request_id][1].block_id for r in running}
    saved = [(r, r.num_computed_tokens, r.kv_failure_until) for r in sched.running]

    def once() -> None:
        handle_invalid_blocks(sched, invalid, {}, StepEvents(step=0))
        for r, computed, until in saved:
            r.num_computed_tokens = computed
            r.kv_failure_until = until
        sched.failed_recving.clear()

    return best_time(once, repeat=5, number=3)


def run(quick: bool = False) -> list[Row]:
    rows = []
    steps, rounds = (20, 3) if quick else (100, 15)
    for n in (16, 64, 256):
        rows.extend(_overhead(n, steps, rounds))

    sizes = (1_000, 10_000, 100_000) if quick else (1_000, 10_000, 100_000, 1_000_000)
    base = None
    for num_blocks in sizes:
        t = _recovery_time(_running_scheduler(128, num_blocks), 16)
        base = base or t
        rows.append(Row("recovery path vs cache size", f"{num_blocks} blocks, 128 running, k=16",
                        t * 1e6, "us", "flat", None))
    rows.append(Row("recovery path vs cache size", "largest / smallest cache", t / base, "x",
                    "~1x", t / base < 2.0))
    big = _running_scheduler(1024, 20_000)
    for k in (1, 16, 256, 1024):
        rows.append(Row("recovery path vs failed blocks", f"1024 running, k={k}",
                        _recovery_time(big, k) * 1e6, "us"))
    for n in (1, 16, 128, 1024):
        rows.append(Row("recovery path vs running requests", f"{n} running, k={n}",
                        _recovery_time(_running_scheduler(n, 20_000), n) * 1e6, "us"))
    return rows


