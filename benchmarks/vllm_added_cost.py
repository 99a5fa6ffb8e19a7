"""kvmetrics' added CPU cost per step on vLLM's scheduler, next to vLLM's own statistics.

Two separately built, identical vLLM schedulers differ by a few percent (memory layout,
call depth), more than the 1 % this has to resolve. So ONE scheduler instance is switched
between code paths step by step, the modes taking turns within every cycle:

- ``vllm``: vLLM's own ``schedule()`` and ``update_from_output()`` called directly (the
  base class's functions), kvmetrics' wrappers on the cache manager, block pool and
  connector taken off the instance, ``log_stats`` off (in a steady decode step vLLM
  calls none of the other overridden methods);
- ``control``: ``vllm`` again, under another name: its difference from ``vllm`` (an A/A
  comparison) is what the method resolves on this machine at that moment;
- ``stats``: the same with ``log_stats`` on (vLLM's scheduler-side statistics);
- ``frame``: ``vllm`` called through one pass-through function per call (no kvmetrics
  work, the arguments passed as they came, as kvmetrics' overrides do on the usual
  call): what running vLLM's code one call deeper costs by itself, as any override does
  (the issue saw the same step cost 12-14 % more at one particular call depth);
- ``kvmetrics``: the instrumented class, wrappers on, ``log_stats`` off, recording into
  a pipeline with a Prometheus sink from inside ``update_from_output()`` (as under
  ``vllm serve``, where the scheduler owns its exporter): everything kvmetrics adds.

Each step's cost is this thread's CPU time in ``schedule()`` plus ``update_from_output()``
(the model runner's part is not timed: it is the same in every mode).

Why these statistics: a step's cost here swings by +-15 % from one step to the next (the
VM's other tenants, cache state; slow and fast stretches of many steps), so the spread of
per-round means is wide and says little about the estimate. Within one cycle (every mode
once, in a fresh random order) the steps are neighbours and share that state, and the
swing is multiplicative, so each mode is compared by the log-ratio of its step to the
``vllm`` step of the same cycle; the estimate is the 10 %-trimmed mean of those over all
cycles (trimmed: a step that met an interrupt says nothing about the code), turned back
into microseconds with the median ``vllm`` step. kvmetrics' own steps are split in two:
on most it does its few inline tests (quiet steps, estimated as above), on a few it
records the step, reads the gauges and reports its CPU (recorded steps: rare and 50-200
us dearer, which a trimmed mean would drop as if they were interrupts, though ``vllm
serve`` runs them); those are taken at their plain mean difference from the ``vllm``
step of their cycle, and the two parts weighted by their share. The gauge read's
wall-time floor is stretched by the number of modes, so that it falls on as many
kvmetrics steps as under ``vllm serve``. Its uncertainty comes from batch means
(16 consecutive batches of cycles: 95 % interval, t with 15 degrees of freedom), which
keeps the slow stretches' correlation in. A verdict is given only where that interval
decides it. The garbage collector is off inside a round (collected while requests are
replaced, untimed): a collection lands on whichever step allocates last, noise to every
mode. Prompt lengths are staggered over a block so that block allocations, and the
evictions that come with them, spread evenly over the steps instead of landing on every
16th step for all requests at once.

The workload is steady decode: requests never finish inside a timed step (they are
replaced, untimed, before they would run out of blocks).
"""

from __future__ import annotations

import gc
import math
import os
import random
import statistics
from dataclasses import dataclass
from time import thread_time_ns
from typing import Any

MODES = ("vllm", "control", "stats", "frame", "kvmetrics")
#: Wrapped helper methods, by the helper object that holds them.
WRAPPED = {"kv_cache_manager": ("record_prefix_cache_stats", "evict_blocks",
                                "reset_prefix_cache"),
           "block_pool": ("_maybe_evict_cached_block",),
           "connector": ("update_state_after_alloc",)}
BATCHES = 16
#: Two-sided 95 % quantile of Student's t with BATCHES - 1 degrees of freedom.
T95 = 2.131
TRIM = 0.10


@dataclass(frozen=True)
class Estimate:
    """A per-step cost in microseconds with its 95 % interval."""

    us: float
    low: float
    high: float

    def decides_below(self, bound: float) -> bool | None:
        """True / False when the whole interval is below / above ``bound``, else None."""
        if self.high < bound:
            return True
        if self.low > bound:
            return False
        return None

    def text(self) -> str:
        return f"us/step (95 % CI {self.low:.2f}..{self.high:.2f})"


@dataclass
class AddedCost:
    """Per-step figures for one size of the running batch."""

    running: int
    cycles: int
    vllm_us: float  # median vLLM step, stats off
    control: Estimate  # control - vllm: what the method resolves (should hold 0)
    stats: Estimate  # vLLM's own statistics
    frame: Estimate  # one pass-through frame
    added: Estimate  # kvmetrics
    added_minus_stats: Estimate
    reported_us: float  # kvmetrics' own counter per kvmetrics step, whole run
    #: Its parts per kvmetrics step: the quiet step sampled in place, the eviction
    #: wrapper's calibrated cost, and the rest (timed every time).
    sampled_us: float = 0.0
    evict_us: float = 0.0
    #: The share of kvmetrics steps where it did work it times (recorded steps), and
    #: what those steps measured above the ``vllm`` step of their cycle, per step.
    busy_share: float = 0.0
    busy_us: float = 0.0

    @property
    def bias(self) -> Estimate:
        """The counter against the added cost, as a fraction (interval from the added
        cost's; the counter's own spread is far smaller)."""
        def b(added: float) -> float:
            return self.reported_us / added - 1 if added > 0 else math.inf
        lo, hi = sorted((b(self.added.high), b(self.added.low)))
        return Estimate(b(self.added.us), lo, hi)


def _trimmed_mean(values: list[float]) -> float:
    ordered = sorted(values)
    cut = int(len(ordered) * TRIM)
    return statistics.fmean(ordered[cut:len(ordered) - cut])


def _interval(centre: float, batches: list[float]) -> Estimate:
    """``centre`` with a 95 % interval from the spread of per-batch estimates."""
    if len(batches) < BATCHES:
        return Estimate(centre, -math.inf, math.inf)
    half = T95 * statistics.stdev(batches) / math.sqrt(len(batches))
    return Estimate(centre, centre - half, centre + half)


def _batched(values: list[Any]) -> list[list[Any]]:
    size = len(values) // BATCHES
    if size < 3:
        return []
    return [values[i * size:(i + 1) * size] for i in range(BATCHES)]


def estimate(log_ratios: list[float], scale_us: float) -> Estimate:
    """The trimmed mean of per-cycle log-ratios as microseconds on a ``scale_us`` step,
    with a 95 % interval from batch means."""

    def us(r: float) -> float:
        return (math.exp(r) - 1) * scale_us

    return _interval(us(_trimmed_mean(log_ratios)),
                     [us(_trimmed_mean(b)) for b in _batched(log_ratios)])


def _stratified_us(cycles: list[tuple[float, float, bool]], scale_us: float) -> float:
    """The mean added cost over ``cycles`` of (mode step, ``vllm`` step, busy): the
    quiet cycles by the trimmed mean of their log-ratios, the busy ones (kvmetrics did
    its periodic or event work in that step) by their plain mean difference, each
    weighted by its share. Trimming alone would drop the busy steps, rare and costly,
    as if they were interrupts: they are part of what ``vllm serve`` runs."""
    quiet = [math.log(a / b) for a, b, busy in cycles if not busy]
    busy_us = sum(a - b for a, b, busy in cycles if busy)
    quiet_us = (math.exp(_trimmed_mean(quiet)) - 1) * scale_us if quiet else 0.0
    return (len(quiet) * quiet_us + busy_us) / len(cycles)


def stratified(cycles: list[tuple[float, float, bool]], scale_us: float) -> Estimate:
    """:func:`_stratified_us` with a 95 % interval from batch estimates."""
    return _interval(_stratified_us(cycles, scale_us),
                     [_stratified_us(b, scale_us) for b in _batched(cycles)])


class Switch:
    """Switches one instrumented scheduler between its code paths."""

    def __init__(self, sched: Any) -> None:
        from kvmetrics.integrations.vllm import hooks

        self.sched = sched
        self.kv_cls = type(sched)
        self.base = hooks.vllm_base(self.kv_cls)
        self.on = True
        self.holders = {"kv_cache_manager": sched.kv_cache_manager,
                        "block_pool": sched.kv_cache_manager.block_pool,
                        "connector": sched.connector}
        self.wrappers = {(holder, name): obj.__dict__[name]
                         for holder, obj in self.holders.items() if obj is not None
                         for name in WRAPPED[holder] if name in obj.__dict__}

    def set(self, mode: str) -> None:
        sched = self.sched
        on = self.on = mode == "kvmetrics"
        sched.log_stats = mode == "stats"
        for (holder, name), fn in self.wrappers.items():
            obj = self.holders[holder].__dict__
            if on:
                obj[name] = fn
            else:
                obj.pop(name, None)


def _staggered(requests: list[Any]) -> list[Any]:
    """Cut request i's prompt by i mod 16 tokens (block allocations spread over steps)."""
    from kvmetrics.engine.tokens import ExplicitTokens

    for i, request in enumerate(requests):
        ids = request.prompt.tokens(0, len(request.prompt))
        request.prompt = ExplicitTokens(ids[:len(ids) - i % 16])
    return requests


def measure(n: int, cycles: int, refill_every: int = 900) -> AddedCost:
    """Added cost at ``n`` running decodes over ``cycles`` cycles (every mode once each)."""
    from benchmarks.bench_vllm import _requests, _vllm_engine
    from kvmetrics.exporters.prometheus import PrometheusSink
    from kvmetrics.metrics.pipeline import MetricsPipeline

    engine = _vllm_engine(n, True)
    sched = engine.scheduler
    sched.kvmetrics_pipeline = MetricsPipeline([PrometheusSink()], engine_kind="vllm")
    # The periodic gauge read is due by wall time (0.25 s); kvmetrics runs one step in
    # len(MODES) here, so its floor is stretched by as much: a read per as many
    # kvmetrics steps as under ``vllm serve``.
    sched._kv_read_gap_ns *= len(MODES)
    switch = Switch(sched)
    base = switch.base

    # The least any override costs: one function that calls vLLM's with the arguments
    # it got, as kvmetrics' overrides do on the usual call.
    def frame_schedule(self: Any) -> Any:
        return base.schedule(self)

    def frame_update(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        return base.update_from_output(self, scheduler_output, model_runner_output)

    generation = 0
    done = 0

    def refill() -> None:
        nonlocal generation, done
        switch.set("kvmetrics")
        for rid in list(sched.requests):
            engine.abort(rid)
        generation += 1
        for request in _staggered(_requests(n, seed=generation)):
            request.request_id = f"g{generation}-{request.request_id}"
            engine.add_request(request)
        for _ in range(2):
            engine.step()  # prefill, untimed
        gc.collect()
        done = 0

    rng = random.Random(n)
    spent: dict[str, list[float]] = {m: [] for m in MODES}
    #: Per kvmetrics step: whether kvmetrics did work it times (a recorded step).
    busy: list[bool] = []
    reported_ns = 0.0
    gc_was_on = gc.isenabled()
    refill()
    gc.disable()
    try:
        cpu0, calls0 = sched.kvmetrics_cpu_seconds, sched._kv.evict_calls
        evict_calls = 0
        for _ in range(cycles):
            if done + len(MODES) > refill_every:
                reported_ns += (sched.kvmetrics_cpu_seconds - cpu0) * 1e9
                evict_calls += sched._kv.evict_calls - calls0
                refill()  # untimed, and its kvmetrics time left out
                cpu0, calls0 = sched.kvmetrics_cpu_seconds, sched._kv.evict_calls
            # Each cycle in a fresh random order, so that every mode follows every other
            # equally often (a step's cost depends a little on the one before).
            for mode in rng.sample(MODES, len(MODES)):
                switch.set(mode)
                if switch.on:
                    schedule, update = type(sched).schedule, type(sched).update_from_output
                elif mode == "frame":
                    schedule, update = frame_schedule, frame_update
                else:
                    schedule, update = base.schedule, base.update_from_output
                timed0 = sched.kvmetrics_cpu_ns + sched._kv_cpu_ns
                t0 = thread_time_ns()
                out = schedule(sched)
                t1 = thread_time_ns()
                record = engine._execute(out)
                t2 = thread_time_ns()
                update(sched, out, record.vllm_result)
                t3 = thread_time_ns()
                spent[mode].append(((t1 - t0) + (t3 - t2)) / 1e3)
                if switch.on:
                    busy.append(sched.kvmetrics_cpu_ns + sched._kv_cpu_ns != timed0)
                done += 1
        switch.set("kvmetrics")
        reported_ns += (sched.kvmetrics_cpu_seconds - cpu0) * 1e9
        evict_calls += sched._kv.evict_calls - calls0
    finally:
        if gc_was_on:
            gc.enable()
    engine.close()
    vllm = spent["vllm"]
    scale = statistics.median(vllm)

    def ratios(mode: str) -> list[float]:
        return [math.log(a / b) for a, b in zip(spent[mode], vllm, strict=True)]

    def versus(mode: str) -> Estimate:
        return estimate(ratios(mode), scale)

    kv = list(zip(spent["kvmetrics"], vllm, busy, strict=True))
    added = stratified(kv, scale)
    stats = versus("stats")

    def stats_us(r: list[float]) -> float:
        return (math.exp(_trimmed_mean(r)) - 1) * scale

    # Added minus stats, batch by batch (the same cycles on both sides).
    minus = _interval(added.us - stats.us,
                      [_stratified_us(k, scale) - stats_us(r) for k, r in
                       zip(_batched(kv), _batched(ratios("stats")), strict=True)])
    busy_part = sum(a - b for a, b, was in kv if was) / len(kv)
    return AddedCost(n, cycles, scale, versus("control"), stats, versus("frame"),
                     added, minus, reported_ns / 1e3 / cycles, sched._kv_samples.step_ns() / 1e3,
                     sched._kv_cal.evict_ns * evict_calls / 1e3 / cycles,
                     sum(busy) / len(busy), busy_part)


def rows(quick: bool = False) -> list[Any]:
    from benchmarks.common import Row

    cycles = 320 if quick else 3200
    out: list[Row] = []
    for n in (16, 64, 256):
        load_before = os.getloadavg()[0]
        c = measure(n, cycles)
        case = f"{n} running, {c.cycles} cycles of {len(MODES)} modes"
        # Other processes on the machine widen every interval: say how busy it was
        # (this benchmark itself keeps one core busy).
        out.append(Row("load average (1 min), before / after", case, load_before,
                       f"/ {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"))
        below = c.added_minus_stats.decides_below(0)
        bias = c.bias
        within = (True if bias.low >= -0.2 and bias.high <= 0.2
                  else False if bias.high < -0.2 or bias.low > 0.2 else None)
        out += [
            Row("vLLM scheduler CPU/step, stats off (median)", case, c.vllm_us, "us"),
            Row("A/A control (vLLM - vLLM)", case, c.control.us, c.control.text()),
            Row("vLLM's own stats (log_stats on - off)", case, c.stats.us, c.stats.text()),
            Row("one pass-through frame (no kvmetrics work)", case, c.frame.us,
                c.frame.text()),
            Row("kvmetrics added cost", case, c.added.us, c.added.text()),
            Row("kvmetrics added - vLLM's own stats", case, c.added_minus_stats.us,
                c.added_minus_stats.text(),
                "< 0" if below is not None else "< 0 (not resolved: the CI holds 0)", below),
            Row("kvmetrics added cost share", case, 100 * c.added.us / c.vllm_us,
                "% of vLLM's scheduler CPU"),
            Row("recorded steps (kvmetrics timed work), measured", case, c.busy_us,
                f"us/step over all kvmetrics steps ({100 * c.busy_share:.2f} % of them; "
                f"the counter's timed part: {c.reported_us - c.sampled_us - c.evict_us:.2f})"),
            Row("kvmetrics self-reported CPU", case, c.reported_us,
                f"us/step (quiet step sampled {c.sampled_us:.2f}, eviction wrapper "
                f"{c.evict_us:.2f}, timed {c.reported_us - c.sampled_us - c.evict_us:.2f})"),
            Row("self-reported vs added (bias)", case, 100 * bias.us,
                f"% (95 % CI {100 * bias.low:.0f}..{100 * bias.high:.0f})",
                "within +-20%" if within is not None else "within +-20% (not resolved)",
                within),
        ]
    return out


if __name__ == "__main__":
    import argparse
    import logging

    from benchmarks.common import render

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print(render(rows(parser.parse_args().quick)))
