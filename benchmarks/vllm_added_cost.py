"""kvmetrics' added CPU cost per step on vLLM's scheduler, next to vLLM's own statistics.

Two separately built, identical vLLM schedulers differ by a few percent (memory layout,
call depth), more than the 1 % this has to resolve. So ONE scheduler instance is switched
between code paths step by step, the modes taking turns within every round:

- ``vllm``: vLLM's own ``schedule()`` and ``update_from_output()`` called directly (the
  base class's functions), kvmetrics' wrappers on the cache manager, block pool and
  connector taken off the instance, ``log_stats`` off (in a steady decode step vLLM
  calls none of the other overridden methods);
- ``control``: ``vllm`` again, under another name: its difference from ``vllm`` (an A/A
  comparison) is what the method resolves on this machine at that moment;
- ``stats``: the same with ``log_stats`` on (vLLM's scheduler-side statistics);
- ``frame``: ``vllm`` called through one pass-through function per call (no kvmetrics
  work): what running vLLM's code one call deeper costs by itself, as any override does
  (the issue saw the same step cost 12-14 % more at one particular call depth);
- ``kvmetrics``: the instrumented class, wrappers on, ``log_stats`` off, recording into
  a pipeline with a Prometheus sink from inside ``update_from_output()`` (as under
  ``vllm serve``, where the scheduler owns its exporter): everything kvmetrics adds.

Each step's cost is this thread's CPU time in ``schedule()`` plus ``update_from_output()``
(the model runner's part is not timed: it is the same in every mode). Per round, each
mode's mean; the added costs are per-round differences, reported as median and
interquartile range over rounds. The workload is steady decode: requests never finish
inside a timed step (they are replaced, untimed, before they would run out of blocks).
"""

from __future__ import annotations

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


@dataclass
class AddedCost:
    """Per-step figures in microseconds: medians over rounds, with their IQR."""

    running: int
    rounds: int
    steps: int
    vllm_us: float
    control_us: tuple[float, float, float]  # (q1, median, q3) of control - vllm: resolution
    stats_us: tuple[float, float, float]  # (q1, median, q3) of stats - vllm
    frame_us: tuple[float, float, float]  # (q1, median, q3) of frame - vllm
    added_us: tuple[float, float, float]  # (q1, median, q3) of kvmetrics - vllm
    reported_us: float  # kvmetrics' own counter per kvmetrics step, over all rounds
    bias: float  # reported / added - 1, both over all rounds (the counter is sampled)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 4:
        m = statistics.median(values)
        return min(values), m, max(values)
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


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


def measure(n: int, rounds: int, steps: int, refill_every: int = 900) -> AddedCost:
    """Added cost at ``n`` running decodes: ``rounds`` rounds of ``steps`` steps a mode."""
    from benchmarks.bench_vllm import _requests, _vllm_engine
    from kvmetrics.exporters.prometheus import PrometheusSink
    from kvmetrics.metrics.pipeline import MetricsPipeline

    engine = _vllm_engine(n, True)
    sched = engine.scheduler
    sched.kvmetrics_pipeline = MetricsPipeline([PrometheusSink()], engine_kind="vllm")
    switch = Switch(sched)
    base = switch.base

    def frame_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        return base.schedule(self, *args, **kwargs)

    def frame_update(self: Any, *args: Any, **kwargs: Any) -> Any:
        return base.update_from_output(self, *args, **kwargs)

    generation = 0
    done = 0

    def refill() -> None:
        nonlocal generation, done
        switch.set("kvmetrics")
        for rid in list(sched.requests):
            engine.abort(rid)
        generation += 1
        for request in _requests(n, seed=generation):
            request.request_id = f"g{generation}-{request.request_id}"
            engine.add_request(request)
        for _ in range(2):
            engine.step()  # prefill, untimed
        done = 0

    rng = random.Random(n)
    per_mode: dict[str, list[float]] = {m: [] for m in MODES}
    reported: list[float] = []
    for _ in range(rounds):
        spent = dict.fromkeys(MODES, 0)
        cpu0 = sched.kvmetrics_cpu_seconds
        order: list[str] = []
        for _ in range(steps * len(MODES)):
            if done >= refill_every:
                before = sched.kvmetrics_cpu_seconds
                refill()
                cpu0 += sched.kvmetrics_cpu_seconds - before  # untimed: left out
            if not order:
                # Each cycle in a fresh random order, so that every mode follows every
                # other equally often (a step's cost depends a little on the one before).
                order = rng.sample(MODES, len(MODES))
            mode = order.pop()
            switch.set(mode)
            if switch.on:
                schedule, update = type(sched).schedule, type(sched).update_from_output
            elif mode == "frame":
                schedule, update = frame_schedule, frame_update
            else:
                schedule, update = base.schedule, base.update_from_output
            t0 = thread_time_ns()
            out = schedule(sched)
            t1 = thread_time_ns()
            record = engine._execute(out)
            t2 = thread_time_ns()
            update(sched, out, record.vllm_result)
            t3 = thread_time_ns()
            spent[mode] += (t1 - t0) + (t3 - t2)
            done += 1
        switch.set("kvmetrics")
        for m in MODES:
            per_mode[m].append(spent[m] / steps / 1e3)
        own = (sched.kvmetrics_cpu_seconds - cpu0) * 1e6 / steps
        reported.append(own)
    engine.close()
    control = [c - v for c, v in zip(per_mode["control"], per_mode["vllm"], strict=True)]
    stats = [s - v for s, v in zip(per_mode["stats"], per_mode["vllm"], strict=True)]
    frame = [f - v for f, v in zip(per_mode["frame"], per_mode["vllm"], strict=True)]
    added = [k - v for k, v in zip(per_mode["kvmetrics"], per_mode["vllm"], strict=True)]
    return AddedCost(n, rounds, steps, statistics.median(per_mode["vllm"]), _quartiles(control),
                     _quartiles(stats), _quartiles(frame),
                     _quartiles(added), statistics.mean(reported),
                     statistics.mean(reported) / statistics.mean(added) - 1)


def rows(quick: bool = False) -> list[Any]:
    from benchmarks.common import Row

    rounds, steps = (6, 30) if quick else (32, 100)
    out: list[Row] = []
    for n in (16, 64, 256):
        load_before = os.getloadavg()[0]
        c = measure(n, rounds, steps)
        case = f"{n} running, {c.rounds} rounds x {c.steps} steps/mode"
        # Other processes on the machine widen every interval: say how busy it was
        # (this benchmark itself keeps one core busy).
        out.append(Row("load average (1 min), before / after", case, load_before,
                       f"/ {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"))
        # A verdict only where the method resolves vLLM's own stats cost at all.
        resolved = 0 < c.control_us[2] - c.control_us[0] < c.stats_us[1]
        out += [
            Row("vLLM scheduler CPU/step, stats off", case, c.vllm_us, "us"),
            Row("A/A control (vLLM - vLLM)", case, c.control_us[1],
                f"us/step (IQR {c.control_us[0]:.2f}..{c.control_us[2]:.2f})"),
            Row("vLLM's own stats (log_stats on - off)", case, c.stats_us[1],
                f"us/step (IQR {c.stats_us[0]:.2f}..{c.stats_us[2]:.2f})"),
            Row("one pass-through frame (no kvmetrics work)", case, c.frame_us[1],
                f"us/step (IQR {c.frame_us[0]:.2f}..{c.frame_us[2]:.2f})"),
            Row("kvmetrics added cost", case, c.added_us[1],
                f"us/step (IQR {c.added_us[0]:.2f}..{c.added_us[2]:.2f})",
                "<= vLLM's own stats" if resolved else "not resolved: A/A IQR > vLLM's stats",
                c.added_us[1] <= c.stats_us[1] if resolved else None),
            Row("kvmetrics added cost share", case, 100 * c.added_us[1] / c.vllm_us,
                "% of vLLM's scheduler CPU"),
            Row("kvmetrics self-reported CPU", case, c.reported_us, "us/step"),
            Row("self-reported vs added (bias)", case, 100 * c.bias, "%", "within +-20%",
                abs(c.bias) <= 0.2),
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
