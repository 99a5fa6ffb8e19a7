"""Soak campaigns: many small seeded scenarios with random faults, policies and pressure.

Each scenario is fully described by its seed, so a failure prints the one
command that reproduces it. Invariant breaks, guard refusals and verifier
findings are tallied separately; in the unified accounting all must stay zero.

A campaign scales out two ways, both giving exactly the report of one process
except for wall time: ``jobs`` runs scenarios in worker processes (results are
taken in seed order), and a :class:`Shard` runs a deterministic contiguous slice
of the seed range so that a batch system (``deploy/kubernetes/soak-job.yaml``)
can spread a campaign over machines; :func:`merge_reports` puts the shards'
reports back together (:mod:`kvmetrics.lab.soak_report`).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Generator, Sequence
from contextlib import closing

from kvmetrics.lab.config import LabConfig
from kvmetrics.lab.runner import run_lab
from kvmetrics.lab.soak_pool import run_in_workers
from kvmetrics.lab.soak_report import (
    Campaign,
    ScenarioOutcome,
    Shard,
    SoakReport,
    SoakReportError,
    merge_reports,
)

__all__ = ["Campaign", "ScenarioOutcome", "Shard", "SoakReport", "SoakReportError",
           "merge_reports", "run_scenario", "scenario_config", "soak"]


def scenario_config(seed: int, engine: str, accounting: str, verify: str,
                    recovery: str = "vllm") -> LabConfig:
    """A random but reproducible scenario: small enough to run in a fraction of a second.

    It covers what the recovery-path defects need (docs/vllm-defects.md): preemption
    pressure, failed sync and async loads, aborts right after admission, chunked
    recomputes, bursts of requests sharing freshly loaded blocks, and both lockstep
    and async scheduling. ``recovery`` applies to every engine (on vLLM: its
    scheduler's protective mode).
    """
    rng = random.Random(seed)
    block_size = rng.choice((8, 16, 16))
    return LabConfig(
        engine=engine,
        # Workloads that share prefixes: rag and agent share system prompts and
        # documents, chat resends its history; a burst of them shares blocks freshly
        # loaded in the same step.
        workload=rng.choice(("chat", "agent", "rag", "mixed")),
        max_requests=rng.randint(10, 40),
        block_size=block_size,
        # Around "barely fits the longest request": evictions make later requests load
        # their prefixes from the store, and decodes preempt.
        num_gpu_blocks=int(rng.choice((0.75, 1, 1, 1.5)) * (2048 // block_size)) + 2,
        max_num_seqs=rng.choice((4, 8, 32)),
        max_num_batched_tokens=rng.choice((64, 256, 1024)),
        fault_rate=rng.choice((0.1, 0.3, 0.5)),
        fault_mode=rng.choice(("sync", "async", "mixed")),
        policy=rng.choice(("recompute", "fail")),
        accounting=accounting,
        recovery=recovery,
        store_blocks=rng.choice((0, 512, 2048, 2048, 2048)),
        abort_rate=rng.choice((0.0, 0.2, 0.4)),
        # Aborts right after admission, when the request's load may just have failed.
        abort_within_steps=rng.choice((2, 40)),
        verify=verify,
        seed=seed,
        progress=False,
        # vLLM's async scheduling (its default on GPUs) half the time.
        async_scheduling=rng.random() < 0.5,
        # Chunked recomputes: below a block, the recompute of a failed block spans
        # steps and its sharers meet it part-way.
        long_prefill_token_threshold=rng.choice((0, 0, block_size // 2, 2 * block_size)),
        # Bursts of arrivals per step: same-step sharers of freshly loaded blocks.
        step_seconds=rng.choice((0.02, 0.1)),
        # vLLM's admission gate on the whole prompt (its default) or the first chunk.
        reserve_full_prompt=rng.random() < 0.5,
    )


def run_scenario(seed: int, engine: str, accounting: str = "unified",
                 verify: str = "full", recovery: str = "vllm") -> ScenarioOutcome:
    cfg = scenario_config(seed, engine, accounting, verify, recovery)
    try:
        result = run_lab(cfg)
    except Exception as e:  # a crash is a finding, reported with its seed
        return ScenarioOutcome(seed, engine, 0, 0, 0, error=f"{type(e).__name__}: {e}")
    summary = result.summary
    return ScenarioOutcome(seed, engine, summary["invariant_violations"],
                           summary["guard_rejected_increments"],
                           summary["verification"]["failed_blocks"])


Task = tuple[int, str, str, str, str]


def _tasks(campaign: Campaign, seeds: range) -> list[Task]:
    return [(seed, engine, campaign.accounting, campaign.verify, campaign.recovery)
            for seed in seeds for engine in campaign.engines]


def _quiet() -> None:
    """Findings are tallied, not logged."""
    for name in ("kvmetrics", "vllm"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _init_worker() -> None:
    # One intra-op thread per worker: N workers on N cores, not N x N threads.
    # Torch is not imported yet in a fresh (spawned) worker, so this takes effect.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    _quiet()


def _run_task(task: Task) -> ScenarioOutcome:
    return run_scenario(*task)


def _died(task: Task, why: str) -> ScenarioOutcome:
    return ScenarioOutcome(task[0], task[1], 0, 0, 0, error=why)


def _outcomes(tasks: list[Task], jobs: int,
              on_workers: Callable[[list[int]], None] | None) -> Generator[ScenarioOutcome]:
    if jobs <= 1 or len(tasks) <= 1:
        for task in tasks:
            yield _run_task(task)
        return
    # Results come back in task order, so the report does not depend on scheduling.
    yield from run_in_workers(tasks, jobs, _run_task, _died, init=_init_worker,
                              on_start=on_workers)


def soak(num_scenarios: int, engines: Sequence[str] = ("reference",), seed: int = 0,
         accounting: str = "unified", verify: str = "full",
         on_progress: Callable[[SoakReport], None] | None = None,
         recovery: str = "vllm", *, jobs: int = 1, shard: Shard | None = None,
         on_workers: Callable[[list[int]], None] | None = None) -> SoakReport:
    """Run the campaign's scenarios (``shard``: only its slice) in ``jobs`` processes.

    An interrupt (KeyboardInterrupt, or the CLI's SIGTERM handler's subclass of it)
    stops the workers and returns the report of the scenarios finished so far, with
    ``interrupted`` set to the signal number."""
    campaign = Campaign(num_scenarios, seed, tuple(engines), accounting, verify, recovery)
    shard = shard or Shard(0, 1)
    seeds = shard.seeds(campaign)
    report = SoakReport(campaign, shard)
    start = time.monotonic()
    outcomes = _outcomes(_tasks(campaign, seeds), jobs, on_workers)
    try:
        with closing(outcomes):  # stops the workers now, not when garbage collected
            for i, outcome in enumerate(outcomes, start=1):
                report.add(outcome)
                if on_progress is not None and i % len(campaign.engines) == 0:
                    on_progress(report)
    except KeyboardInterrupt as e:
        report.interrupted = getattr(e, "signum", signal.SIGINT)
    report.wall_seconds = time.monotonic() - start
    return report
