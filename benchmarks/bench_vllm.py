"""vLLM's real scheduler: instrumentation overhead, reference-vs-vLLM step time, recovery scaling.

kvmetrics' added cost per step is measured on one scheduler switching code paths step
by step (:mod:`benchmarks.vllm_added_cost`); the two-scheduler wall ratio below cannot
resolve 1 % (two identical vLLM schedulers differ by a few percent).

Scheduler time is what is measured (``schedule()`` plus ``update_from_output()``),
not the model runner's, which is the same on both sides of every ratio.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any

from benchmarks import vllm_added_cost
from benchmarks.common import Row
from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.lab.engine.connector import StoreConnector
from kvmetrics.lab.engine.executor import SimulatedExecutor
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.loop import EngineLoop
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.scheduler import Scheduler, SchedulerConfig
from kvmetrics.lab.engine.tokens import ExplicitTokens
from kvmetrics.metrics.pipeline import MetricsPipeline

PROMPT = 64


class SchedulerClock:
    """Accumulates the time spent inside a scheduler's schedule/update calls
    (wall time by default; ``time.thread_time`` for the thread's CPU time)."""

    def __init__(self, sched: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds = 0.0
        self.clock = clock
        for name in ("schedule", "update_from_output"):
            setattr(sched, name, self._timed(getattr(sched, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = self.clock

        def call(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += clock() - start
        return call


def _config(n: int, blocks: int | None = None) -> SchedulerConfig:
    return SchedulerConfig(block_size=16, num_gpu_blocks=blocks or n * 80 + 64, max_num_seqs=n,
                           max_num_batched_tokens=max(PROMPT * n, 2048), max_model_len=2048,
                           kv_load_failure_policy="recompute", reserve_full_prompt=False)


def _requests(n: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 50_000) for _ in range(32)]  # prefix caching has hits
    return [Request(f"r{i}", ExplicitTokens(shared + [rng.randrange(1, 50_000)
                                                      for _ in range(PROMPT - 32)]),
                    max_tokens=1500) for i in range(n)]


def _vllm_engine(n: int, instrumented: bool, blocks: int | None = None) -> Any:
    from kvmetrics.lab.vllm import builder
    from kvmetrics.lab.vllm.engine import VllmEngine

    store = ExternalStoreIndex(4096)
    cls = builder.INSTRUMENTED if instrumented else "vllm.v1.core.sched.scheduler.Scheduler"
    pipeline = MetricsPipeline([PrometheusSink()], engine_kind="vllm") if instrumented else None
    engine = VllmEngine(_config(n, blocks), SimulatedExecutor(None, store), store=store,
                        scheduler_cls=cls, pipeline=pipeline)
    for request in _requests(n):
        engine.add_request(request)
    engine.step()  # every prompt prefilled: from here on, n running decodes
    return engine


def _reference_loop(n: int) -> tuple[EngineLoop, Scheduler]:
    store = ExternalStoreIndex(4096)
    sched = Scheduler(_config(n), StoreConnector(store, 16, "sync"))
    for request in _requests(n):
        sched.add_request(request)
    loop = EngineLoop(sched, SimulatedExecutor(None, store))
    loop.step()
    sched.drain_events()
    return loop, sched


def _per_step(step: Callable[[], Any], clock: SchedulerClock, steps: int) -> float:
    before = clock.seconds
    for _ in range(steps):
        step()
    return (clock.seconds - before) / steps


def _overhead(n: int, steps: int, rounds: int) -> list[Row]:
    bare, wrapped = _vllm_engine(n, False), _vllm_engine(n, True)
    cb, cw = SchedulerClock(bare.scheduler), SchedulerClock(wrapped.scheduler)
    loop, sched = _reference_loop(n)
    cr = SchedulerClock(sched)
    tb, tw, tr = [], [], []
    for i in range(rounds):
        order = [(bare.step, cb, tb), (wrapped.step, cw, tw),
                 (lambda: (loop.step(), sched.drain_events()), cr, tr)]
        for step, clock, out in (order if i % 2 == 0 else order[::-1]):
            out.append(_per_step(step, clock, steps))
    b, w, r = min(tb), min(tw), min(tr)
    bare.close()
    wrapped.close()
    return [
        Row("instrumentation overhead (vLLM)", f"{n} running", w / b, "x wrapped/bare",
            "<= 1.03x", w / b <= 1.03),
        Row("scheduler step time", f"vLLM, {n} running", b * 1e3, "ms"),
        Row("scheduler step time", f"reference, {n} running", r * 1e3, "ms"),
        Row("scheduler step time", f"vLLM / reference, {n} running", b / r, "x", ">= 2x",
            b / r >= 2.0),
    ]


def _vllm_recovery(n: int, blocks: int, k: int) -> float:
    engine = _vllm_engine(n, False, blocks)
    sched = engine.scheduler
    running = list(sched.running)
    invalid = {sched.kv_cache_manager.get_block_ids(r.request_id)[0][1] for r in running[:k]}
    saved = [(r, r.num_computed_tokens) for r in running]
    best = float("inf")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    for _ in range(5):
        start = time.perf_counter()
        sched._handle_invalid_blocks(invalid, {})
        best = min(best, time.perf_counter() - start)
        for r, computed in saved:
            r.num_computed_tokens = computed
    engine.close()
    return best


def run(quick: bool = False) -> list[Row]:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    rows: list[Row] = []
    steps, rounds = (10, 3) if quick else (50, 11)
    for n in (16, 64, 256):
        rows.extend(_overhead(n, steps, rounds))
    for step_ms in (2.0, vllm_added_cost.STEP_MS):  # a CPU server's step, a GPU server's
        rows.extend(vllm_added_cost.rows(quick, step_ms=step_ms))
    sizes = (1_000, 10_000) if quick else (1_000, 10_000, 100_000, 1_000_000)
    times = [_vllm_recovery(128, size, 16) for size in sizes]
    for size, t in zip(sizes, times, strict=True):
        rows.append(Row("recovery path vs cache size (vLLM)",
                        f"{size} blocks, 128 running, k=16", t * 1e6, "us"))
    rows.append(Row("recovery path vs cache size (vLLM)", "largest / smallest cache",
                    times[-1] / times[0], "x", "~1x", times[-1] / times[0] < 2.0))
    for n in (1, 16, 128) if quick else (1, 16, 128, 1024):
        t = _vllm_recovery(n, max(20_000, n * 8), n)
        rows.append(Row("recovery path vs running requests (vLLM)", f"{n} running, k={n}",
                        t * 1e6, "us"))
    return rows
