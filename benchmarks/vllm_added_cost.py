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
  ``vllm serve``, where the scheduler owns its exporter): everything kvmetrics adds;
- ``vllm-inner`` and ``kvmetrics-inner``: ``vllm`` and ``kvmetrics`` again, with vLLM's
  two methods reached through the same pair of timing functions (thread CPU time read
  around each, from inside): the difference of the inner times is what kvmetrics costs
  inside vLLM's methods (vLLM's own code made slower by it, the eviction wrapper that
  runs in ``schedule()``), the rest what it costs outside them (the overrides). This
  splits the added cost by what the exported counter can time and what it cannot.

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

MODES = ("vllm", "control", "stats", "frame", "kvmetrics", "vllm-inner", "kvmetrics-inner")
#: The two modes that also time vLLM's own methods from inside (the split of the cost).
INNER = ("vllm-inner", "kvmetrics-inner")
#: The modes that run kvmetrics (its counter and the gauge cadence are shared by both).
KVMETRICS = ("kvmetrics", "kvmetrics-inner")
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
    timed_us: float = 0.0
    #: The share of kvmetrics steps where it did work it times (recorded steps), and
    #: what those steps measured above the ``vllm`` step of their cycle, per step.
    busy_share: float = 0.0
    busy_us: float = 0.0
    #: The added cost split (the ``-inner`` modes): inside vLLM's two methods (vLLM's
    #: own code made slower, and the eviction wrapper that runs in it) and outside them
    #: (the overrides' own code and calls).
    inside: Estimate | None = None
    outside: Estimate | None = None

    @property
    def bias(self) -> Estimate:
        """The counter against the added cost, as a fraction (interval from the added
        cost's; the counter's own spread is far smaller)."""
        return _bias(self.reported_us, self.added)

    @property
    def outside_bias(self) -> Estimate:
        """The counter's parts outside vLLM's methods against the part measured there."""
        if self.outside is None:
            return Estimate(math.nan, math.nan, math.nan)
        return _bias(self.reported_us - self.evict_us, self.outside)


def _bias(reported: float, measured: Estimate) -> Estimate:
    def b(value: float) -> float:
        return reported / value - 1 if value > 0 else math.inf

    lo, hi = sorted((b(measured.high), b(measured.low)))
    return Estimate(b(measured.us), lo, hi)


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


def _stratified_us(cycles: list[tuple[float, float, bool]], scale_us: float | None) -> float:
    """The mean added cost over ``cycles`` of (mode step, reference step, busy): the
    quiet cycles by the trimmed mean of their log-ratios on a ``scale_us`` step (or, with
    None, of their differences: for small parts whose spread is not multiplicative),
    the busy ones (kvmetrics did its periodic or event work in that step) by their plain
    mean difference, each weighted by its share. Trimming alone would drop the busy
    steps, rare and costly, as if they were interrupts: ``vllm serve`` runs them."""
    busy_us = sum(a - b for a, b, busy in cycles if busy)
    if scale_us is None:
        quiet = [a - b for a, b, busy in cycles if not busy]
        quiet_us = _trimmed_mean(quiet) if quiet else 0.0
    else:
        quiet = [math.log(a / b) for a, b, busy in cycles if not busy]
        quiet_us = (math.exp(_trimmed_mean(quiet)) - 1) * scale_us if quiet else 0.0
    return (len(quiet) * quiet_us + busy_us) / len(cycles)


def stratified(cycles: list[tuple[float, float, bool]], scale_us: float | None) -> Estimate:
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
        on = self.on = mode in KVMETRICS
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
    # The periodic gauge read is due by wall time (0.25 s); kvmetrics runs two steps in
    # len(MODES) here, so its floor is stretched by as much: a read per as many
    # kvmetrics steps as under ``vllm serve``.
    sched._kv.read_gap_ns = round(sched._kv.read_gap_ns * len(MODES) / len(KVMETRICS))
    switch = Switch(sched)
    base = switch.base

    # The least any override costs: one function that calls vLLM's with the arguments
    # it got, as kvmetrics' overrides do on the usual call.
    def frame_schedule(self: Any) -> Any:
        return base.schedule(self)

    def frame_update(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        return base.update_from_output(self, scheduler_output, model_runner_output)

    # vLLM's two methods timed from inside, the same way in both -inner modes: vLLM
    # called through these, or kvmetrics' overrides calling these instead of vLLM's.
    inside_ns = [0]

    def inner_schedule(self: Any) -> Any:
        t0 = thread_time_ns()
        out = base.schedule(self)
        inside_ns[0] = thread_time_ns() - t0
        return out

    def inner_update(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        t0 = thread_time_ns()
        out = base.update_from_output(self, scheduler_output, model_runner_output)
        inside_ns[0] += thread_time_ns() - t0
        return out

    # The counter's timed part, summed as it is counted (outside the refills).
    timed_ns = [0.0]
    kv = sched._kv

    class CountingState(type(kv)):  # type: ignore[misc]
        """The scheduler's state, summing what it counts as timed while measuring."""

        __slots__ = ()

        def timed(self, ns: int) -> None:
            if measuring:
                timed_ns[0] += ns + self.clock_ns
            super().timed(ns)

    kv.__class__ = CountingState
    measuring = False

    next_functions = (sched._kv.next_schedule, sched._kv.next_update)
    if next_functions != (base.schedule, base.update_from_output):
        raise RuntimeError("the benchmark expects kvmetrics' overrides to call vLLM's "
                           "methods directly (the protective mode off)")

    generation = 0
    done = 0

    def refill() -> None:
        nonlocal generation, done, measuring
        measuring = False
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
        measuring = True

    rng = random.Random(n)
    spent: dict[str, list[float]] = {m: [] for m in MODES}
    inside: dict[str, list[float]] = {m: [] for m in INNER}
    #: Per kvmetrics step (each kvmetrics mode): whether kvmetrics did work it times.
    busy: dict[str, list[bool]] = {m: [] for m in KVMETRICS}
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
                if mode == "kvmetrics-inner":
                    sched._kv.next_schedule, sched._kv.next_update = inner_schedule, inner_update
                elif switch.on:
                    sched._kv.next_schedule, sched._kv.next_update = next_functions
                if switch.on:
                    schedule, update = type(sched).schedule, type(sched).update_from_output
                elif mode == "frame":
                    schedule, update = frame_schedule, frame_update
                elif mode == "vllm-inner":
                    schedule, update = inner_schedule, inner_update
                else:
                    schedule, update = base.schedule, base.update_from_output
                timed0 = sched.kvmetrics_cpu_ns + sched._kv.cpu_ns
                t0 = thread_time_ns()
                out = schedule(sched)
                t1 = thread_time_ns()
                record = engine._execute(out)
                t2 = thread_time_ns()
                update(sched, out, record.vllm_result)
                t3 = thread_time_ns()
                spent[mode].append(((t1 - t0) + (t3 - t2)) / 1e3)
                if switch.on:
                    busy[mode].append(sched.kvmetrics_cpu_ns + sched._kv.cpu_ns != timed0)
                if mode in inside:
                    inside[mode].append(inside_ns[0] / 1e3)
                done += 1
        switch.set("kvmetrics")
        measuring = False
        sched._kv.next_schedule, sched._kv.next_update = next_functions
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

    kv = list(zip(spent["kvmetrics"], vllm, busy["kvmetrics"], strict=True))
    added = stratified(kv, scale)
    stats = versus("stats")

    def stats_us(r: list[float]) -> float:
        return (math.exp(_trimmed_mean(r)) - 1) * scale

    # Added minus stats, batch by batch (the same cycles on both sides).
    minus = _interval(added.us - stats.us,
                      [_stratified_us(k, scale) - stats_us(r) for k, r in
                       zip(_batched(kv), _batched(ratios("stats")), strict=True)])
    busy_part = sum(a - b for a, b, was in kv if was) / len(kv)
    # The split: vLLM's methods timed from inside in both -inner modes, and the rest of
    # each step (the overrides, and the same two timing frames on both sides).
    in_kv, in_vllm = inside["kvmetrics-inner"], inside["vllm-inner"]
    inner_busy = busy["kvmetrics-inner"]
    inside_est = stratified(list(zip(in_kv, in_vllm, inner_busy, strict=True)),
                            statistics.median(in_vllm))
    outside_est = stratified(
        [(ka - ki, va - vi, b) for ka, ki, va, vi, b in
         zip(spent["kvmetrics-inner"], in_kv, spent["vllm-inner"], in_vllm, inner_busy,
             strict=True)], None)
    return AddedCost(n, cycles, scale, versus("control"), stats, versus("frame"),
                     # (the counter, and the wrapper's calls, run in both kvmetrics modes)
                     added, minus, reported_ns / 1e3 / cycles / len(KVMETRICS),
                     sched._kv.samples.step_ns() / 1e3,
                     sched._kv.cal.evict_ns * evict_calls / 1e3 / cycles / len(KVMETRICS),
                     timed_ns[0] / 1e3 / cycles / len(KVMETRICS),
                     sum(busy["kvmetrics"]) / cycles, busy_part, inside_est, outside_est)


def rows(quick: bool = False, sizes: tuple[int, ...] = (16, 64, 256),
         cycles: int | None = None) -> list[Any]:
    from benchmarks.common import Row

    if cycles is None:
        cycles = 320 if quick else 3200
    out: list[Row] = []
    for n in sizes:
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
                f"the counter's timed part: {c.timed_us:.2f})"),
            Row("  of which inside vLLM's methods", case, c.inside.us if c.inside else math.nan,
                (c.inside.text() if c.inside else "") + " (vLLM's own code slower with "
                "kvmetrics on, and the eviction wrapper that runs in it)"),
            Row("  of which outside them", case, c.outside.us if c.outside else math.nan,
                (c.outside.text() if c.outside else "") + " (the overrides: their code, "
                "calls, and the recorded steps)"),
            Row("kvmetrics self-reported CPU", case, c.reported_us,
                f"us/step (quiet steps {c.reported_us - c.evict_us - c.timed_us:.2f} at "
                f"{c.sampled_us:.2f} sampled at the end, eviction wrapper {c.evict_us:.2f}, "
                f"timed {c.timed_us:.2f})"),
            Row("self-reported (less eviction wrapper) vs the part outside", case,
                100 * c.outside_bias.us,
                f"% (95 % CI {100 * c.outside_bias.low:.0f}..{100 * c.outside_bias.high:.0f}: "
                "how well the counter times the code it can time)"),
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
    parser.add_argument("--quick", action="store_true", help="320 cycles a size")
    parser.add_argument("--sizes", default="16,64,256",
                        help="running requests, comma-separated (default: 16,64,256)")
    parser.add_argument("--cycles", type=int, default=None,
                        help="cycles a size (default 3,200; the interval narrows as its "
                             "square root: 16,000 at 256 running take about 9 minutes)")
    options = parser.parse_args()
    try:
        sizes = tuple(int(x) for x in options.sizes.split(","))
        if not sizes or min(sizes) < 1 or max(sizes) > 1024:
            raise ValueError
    except ValueError:
        parser.error(f"--sizes: comma-separated counts of 1 to 1024, not {options.sizes!r}")
    if options.cycles is not None and not 16 * 3 <= options.cycles <= 10**6:
        parser.error("--cycles: 48 to 1,000,000 (16 batches of at least 3 cycles)")
    print(render(rows(options.quick, sizes, options.cycles)))
