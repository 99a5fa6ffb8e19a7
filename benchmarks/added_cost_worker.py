"""One process of ``benchmarks.vllm_added_cost``: one size, one scheduler, every mode.

Run by the benchmark as ``python -m benchmarks.added_cost_worker RUNNING CYCLES STEP_MS
SEED``; prints one line, ``RESULT <json>``, with the per-batch differences and the
counter's figures (vLLM's own logging may print before it).
"""

from __future__ import annotations

import gc
import json
import math
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from time import monotonic_ns, thread_time_ns
from typing import Any

from benchmarks.added_cost_design import BATCHES, balanced_order

MODES = ("vllm", "control", "stats", "frame", "kvmetrics")
VLLM, KV, STATS = MODES.index("vllm"), MODES.index("kvmetrics"), MODES.index("stats")
#: The modes compared with ``vllm`` by their plain mean.
COMPARED = ("control", "stats", "frame")
#: Wrapped helper methods, by the helper object that holds them.
WRAPPED = {"kv_cache_manager": ("record_prefix_cache_stats", "evict_blocks",
                                "reset_prefix_cache"),
           "block_pool": ("_maybe_evict_cached_block",),
           "connector": ("update_state_after_alloc",)}
#: The steps a step is classed by when it comes after one: a ``vllm`` step, a quiet
#: ``kvmetrics`` step (not recorded), a ``stats`` step.
AFTER = (VLLM, KV, STATS)
#: A recorded step is followed by at most this many extra kvmetrics steps (normally one).
MAX_AFTER = 4
RESULT = "RESULT "


@dataclass
class Block:
    """Per-mode sums and counts of one balanced block of steps (microseconds); the
    kvmetrics mode holds its slots and the steps run after its recorded ones."""

    sums: list[float] = field(default_factory=lambda: [0.0] * len(MODES))
    counts: list[int] = field(default_factory=lambda: [0] * len(MODES))
    #: Steps of any mode by the step before them (AFTER): what a step leaves to the next.
    after_sums: list[float] = field(default_factory=lambda: [0.0] * len(AFTER))
    after_counts: list[int] = field(default_factory=lambda: [0] * len(AFTER))

    def add(self, mode: int, us: float, before: int | None) -> None:
        self.sums[mode] += us
        self.counts[mode] += 1
        if before is not None:
            self.after_sums[before] += us
            self.after_counts[before] += 1


@dataclass
class ProcessResult:
    """What one process measured at one size (microseconds a step)."""

    running: int
    cycles: int
    step_ms: float
    #: Per batch: each of COMPARED, ``added`` and ``minus`` (added less stats), minus
    #: the ``vllm`` mean of the same batch; ``carry_kvmetrics`` / ``carry_stats``: the
    #: mean step after a quiet kvmetrics / a stats step less the mean after a vllm one.
    diffs: dict[str, list[float]]
    vllm_us: float
    kv_steps: int
    recorded: int
    recorded_us: float  # a recorded step above the mean vLLM step
    after_us: float  # the step run after a recorded one, above the mean vLLM step
    reported_us: float  # kvmetrics' counter per kvmetrics step
    sampled_us: float
    evict_us: float
    timed_us: float


class Switch:
    """Switches one instrumented scheduler between its code paths."""

    def __init__(self, sched: Any) -> None:
        from kvmetrics.vllm import hooks

        self.sched = sched
        self.base = hooks.vllm_base(type(sched))
        self.holders = {"kv_cache_manager": sched.kv_cache_manager,
                        "block_pool": sched.kv_cache_manager.block_pool,
                        "connector": sched.connector}
        self.wrappers = {(holder, name): obj.__dict__[name]
                         for holder, obj in self.holders.items() if obj is not None
                         for name in WRAPPED[holder] if name in obj.__dict__}

    def set(self, mode: int) -> None:
        on = mode == KV
        self.sched.log_stats = mode == STATS
        for (holder, name), fn in self.wrappers.items():
            found = self.holders[holder].__dict__
            if on:
                found[name] = fn
            else:
                found.pop(name, None)


class ServerClock:
    """kvmetrics' clock as under ``vllm serve``: one decode step of ``step_ns`` passes
    for each step kvmetrics runs, whatever the simulator's own step takes."""

    def __init__(self, step_ns: int) -> None:
        self.now_ns = monotonic_ns()
        self.step_ns = step_ns

    def advance(self) -> None:
        self.now_ns += self.step_ns

    def __call__(self) -> int:
        return self.now_ns


def _staggered(requests: list[Any]) -> list[Any]:
    """Cut request i's prompt by i mod 16 tokens (block allocations spread over steps)."""
    from kvmetrics.lab.engine.tokens import ExplicitTokens

    for i, request in enumerate(requests):
        ids = request.prompt.tokens(0, len(request.prompt))
        request.prompt = ExplicitTokens(ids[:len(ids) - i % 16])
    return requests


def _batched(blocks: list[Block]) -> list[Block]:
    """``blocks`` summed into BATCHES consecutive batches of (nearly) equal size."""
    out = []
    for b in range(BATCHES):
        part = blocks[b * len(blocks) // BATCHES:(b + 1) * len(blocks) // BATCHES]
        total = Block()
        for block in part:
            for m in range(len(MODES)):
                total.sums[m] += block.sums[m]
                total.counts[m] += block.counts[m]
            for a in range(len(AFTER)):
                total.after_sums[a] += block.after_sums[a]
                total.after_counts[a] += block.after_counts[a]
        out.append(total)
    return out


def differences(blocks: list[Block]) -> dict[str, list[float]]:
    """Per batch, each mode's mean step less the ``vllm`` mean step of that batch."""
    names = (*COMPARED, "added", "minus", "carry_kvmetrics", "carry_stats")
    diffs: dict[str, list[float]] = {name: [] for name in names}
    for batch in _batched(blocks):
        mean = [s / n for s, n in zip(batch.sums, batch.counts, strict=True)]
        for name in COMPARED:
            diffs[name].append(mean[MODES.index(name)] - mean[VLLM])
        diffs["added"].append(mean[KV] - mean[VLLM])
        diffs["minus"].append(mean[KV] - mean[STATS])
        after = [s / n if n else math.nan
                 for s, n in zip(batch.after_sums, batch.after_counts, strict=True)]
        diffs["carry_kvmetrics"].append(after[AFTER.index(KV)] - after[AFTER.index(VLLM)])
        diffs["carry_stats"].append(after[AFTER.index(STATS)] - after[AFTER.index(VLLM)])
    return diffs


def _check_internals(sched: Any, step_end: Any) -> None:
    """The benchmark steers kvmetrics' schedule through these; say so if one is gone."""
    missing = [f"_kv.{name}" for name in ("read_next_ns", "audit_next", "timed",
                                          "next_schedule", "samples", "cal")
               if not hasattr(sched._kv, name)]
    if not hasattr(step_end, "monotonic_ns"):
        missing.append("step_end.monotonic_ns")
    if missing:
        raise RuntimeError("the benchmark drives kvmetrics through internals that are "
                           f"gone: {', '.join(missing)}")


def measure(n: int, cycles: int, step_ms: float, seed: int,
            refill_every: int = 900) -> ProcessResult:
    """kvmetrics' added cost at ``n`` running decodes, every mode ``cycles`` times
    (rounded up to whole balanced blocks), kvmetrics' clock at ``step_ms`` a step."""
    from benchmarks.bench_vllm import _requests, _vllm_engine
    from kvmetrics.exporters.prometheus import PrometheusSink
    from kvmetrics.metrics.pipeline import MetricsPipeline
    from kvmetrics.vllm import step_end

    engine = _vllm_engine(n, True)
    sched = engine.scheduler
    sched.kvmetrics_pipeline = MetricsPipeline([PrometheusSink()], engine_kind="vllm")
    _check_internals(sched, step_end)
    switch = Switch(sched)
    base, cls = switch.base, type(sched)
    next_functions = (sched._kv.next_schedule, sched._kv.next_update)
    if next_functions != (base.schedule, base.update_from_output):
        raise RuntimeError("the benchmark expects kvmetrics' overrides to call vLLM's "
                           "methods directly (the protective mode off)")

    # The least any override costs: one function that calls vLLM's as kvmetrics' do.
    def frame_schedule(self: Any) -> Any:
        return base.schedule(self)

    def frame_update(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        return base.update_from_output(self, scheduler_output, model_runner_output)

    paths: dict[int, tuple[Callable[..., Any], Callable[..., Any]]] = {
        m: (base.schedule, base.update_from_output) for m in range(len(MODES))}
    paths[KV] = (cls.schedule, cls.update_from_output)
    paths[MODES.index("frame")] = (frame_schedule, frame_update)

    timed_ns = [0.0]  # the counter's timed part, summed as it is counted
    measuring = False
    kv = sched._kv

    class CountingState(type(kv)):  # type: ignore[misc]
        """The scheduler's state, summing what it counts as timed while measuring."""

        __slots__ = ()

        def timed(self, ns: int) -> None:
            if measuring:
                timed_ns[0] += ns + self.clock_ns
            super().timed(ns)

    kv.__class__ = CountingState
    clock = ServerClock(round(step_ms * 1e6))
    real_clock = step_end.monotonic_ns
    step_end.monotonic_ns = clock

    def step(mode: int) -> tuple[float, bool]:
        """One step in ``mode``: its scheduler CPU time (us) and whether kvmetrics did
        work it times in it (a recorded step)."""
        switch.set(mode)
        schedule, update = paths[mode]
        if mode == KV:
            clock.advance()
        timed0 = sched.kvmetrics_cpu_ns + kv.cpu_ns
        t0 = thread_time_ns()
        out = schedule(sched)
        t1 = thread_time_ns()
        record = engine._execute(out)
        t2 = thread_time_ns()
        update(sched, out, record.vllm_result)
        t3 = thread_time_ns()
        return ((t1 - t0) + (t3 - t2)) / 1e3, sched.kvmetrics_cpu_ns + kv.cpu_ns != timed0

    generation = 0

    def refill() -> None:
        """New requests, untimed; kvmetrics records their events, but nothing periodic
        can fall due meanwhile (its schedule is put back after), and one ``vllm`` step
        takes what the refill leaves to the next step."""
        nonlocal generation
        due = kv.read_next_ns, kv.audit_next
        kv.read_next_ns = kv.audit_next = 1 << 62
        switch.set(KV)
        for rid in list(sched.requests):
            engine.abort(rid)
        generation += 1
        for request in _staggered(_requests(n, seed=generation)):
            request.request_id = f"g{generation}-{request.request_id}"
            engine.add_request(request)
        for _ in range(2):
            engine.step()  # prefill
        kv.read_next_ns, kv.audit_next = due
        gc.collect()
        step(VLLM)

    design = balanced_order(len(MODES))
    rng = random.Random(seed)
    blocks: list[Block] = []
    recorded_us: list[float] = []
    after_us: list[float] = []
    vllm_steps: list[float] = []
    reported_ns = 0.0
    evict_calls = kv_steps = done = 0
    order: list[int] = []
    gc_was_on = gc.isenabled()
    try:
        refill()
        gc.disable()
        measuring = True
        cpu0, calls0 = sched.kvmetrics_cpu_seconds, sched._kv.evict_calls
        for _ in range(math.ceil(cycles / len(MODES))):
            if not order or done + 2 * len(design) > refill_every:
                if order:
                    measuring = False
                    reported_ns += (sched.kvmetrics_cpu_seconds - cpu0) * 1e9
                    evict_calls += sched._kv.evict_calls - calls0
                    refill()
                    measuring = True
                    cpu0, calls0 = sched.kvmetrics_cpu_seconds, sched._kv.evict_calls
                # A new labelling each round, started after a ``vllm`` step as the
                # refill ends with one: every block of the round is balanced.
                labels = rng.sample(range(len(MODES)), len(MODES))
                order = [labels[s] for s in design]
                start = rng.choice([i + 1 for i, m in enumerate(order) if m == VLLM])
                order = order[start:] + order[:start]
                done = 0
                before: int | None = AFTER.index(VLLM)  # the refill's last step
            block = Block()
            for mode in order:
                us, recorded = step(mode)
                block.add(mode, us, before)
                before = AFTER.index(mode) if mode in AFTER and not recorded else None
                done += 1
                if mode == VLLM:
                    vllm_steps.append(us)
                if mode != KV:
                    continue
                kv_steps += 1
                # What a recorded step leaves to the next one is kvmetrics' too: under
                # ``vllm serve`` the next step is a kvmetrics step, so one runs here.
                for _ in range(MAX_AFTER):
                    if not recorded:
                        break
                    recorded_us.append(us)
                    us, recorded = step(KV)
                    after_us.append(us)
                    block.add(KV, us, None)  # after a recorded step: counted above
                    before = None if recorded else AFTER.index(KV)
                    kv_steps += 1
                    done += 1
            blocks.append(block)
        measuring = False
        reported_ns += (sched.kvmetrics_cpu_seconds - cpu0) * 1e9
        evict_calls += sched._kv.evict_calls - calls0
    finally:
        step_end.monotonic_ns = real_clock
        switch.set(KV)
        if gc_was_on:
            gc.enable()
    engine.close()
    vllm_us = statistics.fmean(vllm_steps)
    return ProcessResult(
        n, len(blocks) * len(MODES), step_ms, differences(blocks), vllm_us, kv_steps,
        len(recorded_us),
        statistics.fmean(recorded_us) - vllm_us if recorded_us else math.nan,
        statistics.fmean(after_us) - vllm_us if after_us else math.nan,
        reported_ns / 1e3 / kv_steps, kv.samples.step_ns() / 1e3,
        kv.cal.evict_ns * evict_calls / 1e3 / kv_steps, timed_ns[0] / 1e3 / kv_steps)


def main(argv: list[str]) -> int:
    import logging
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    running, cycles, step_ms, seed = int(argv[0]), int(argv[1]), float(argv[2]), int(argv[3])
    result = measure(running, cycles, step_ms, seed)
    print(RESULT + json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
