"""One fault workload on vLLM's real scheduler, with vLLM's own figures beside kvmetrics'.

The same workload runs twice in one process on the same (possibly mutated) vLLM: once
with vLLM's own scheduler class and once with kvmetrics' instrumented one. Each run
records what vLLM itself says, read from its state and never from kvmetrics: finish
reasons from request statuses, preemptions from status transitions, evicted blocks from
the block pool's cached hashes, prefix-cache queries and hits from vLLM's
``PrefixCacheStats``, rescheduled requests and affected tokens from vLLM's "Recovered
from KV load failure" log line. The instrumented run also returns the Prometheus page.

A mutant's module is laid over the installed vLLM by putting its folder first on the
``__path__`` of the module's package (:func:`overlay`), so the rest of vLLM, its
version string included, stays the installed one.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import traceback
import urllib.request
from collections import Counter
from dataclasses import replace
from typing import Any

#: Modules whose import would load a mutated module: the forking parent must not import them.
WARM_IMPORTS = ("torch", "vllm", "vllm.config", "vllm.sampling_params")

_RECOVERED = re.compile(r"Recovered from KV load failure: (\d+) request\(s\) rescheduled "
                        r"\((\d+) tokens affected\)")


def overlay(module: str, folder: str) -> None:
    """Make ``module`` load from ``folder`` (which holds ``<leaf>.py``) instead."""
    package = importlib.import_module(module.rpartition(".")[0])
    package.__path__.insert(0, folder)


class _RecoveryLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.requests = 0

    def emit(self, record: logging.LogRecord) -> None:
        found = _RECOVERED.search(record.getMessage())
        if found:
            self.requests += int(found.group(1))


def _cached_hashes(sched: Any) -> dict[int, Any]:
    pool = sched.kv_cache_manager.block_pool
    return {b.block_id: b.block_hash for b in pool.blocks if b.block_hash is not None}


class _Oracle:
    """vLLM's own figures, observed between steps."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.preempted: set[str] = set()
        self.figures: Counter[str] = Counter()
        self.hashes = _cached_hashes(sched)

    def observe(self, requests: dict[str, Any]) -> None:
        from vllm.v1.request import RequestStatus

        now = {rid for rid, r in requests.items() if r.status == RequestStatus.PREEMPTED}
        self.figures["preemptions"] += len(now - self.preempted)
        self.preempted = now
        hashes = _cached_hashes(self.sched)
        self.figures["evicted_blocks"] += sum(
            1 for bid, h in self.hashes.items() if hashes.get(bid) != h)
        self.hashes = hashes


def run(instrumented: bool) -> dict[str, Any]:
    """The fault workload; vLLM's decisions, outcomes and figures (and kvmetrics' page)."""
    from kvmetrics.lab.engine.config import SchedulerConfig
    from kvmetrics.lab.engine.executor import SimulatedExecutor
    from kvmetrics.lab.engine.external_store import ExternalStoreIndex
    from kvmetrics.lab.engine.faults import FaultPlan
    from kvmetrics.lab.vllm.differential import random_workload, vllm_faithful
    from kvmetrics.lab.vllm.engine import VllmEngine

    config = vllm_faithful(SchedulerConfig(
        block_size=16, num_gpu_blocks=30, max_num_seqs=8, max_num_batched_tokens=128,
        max_model_len=1024, kv_load_failure_policy="recompute"))
    spec = random_workload(4, 30, load_mode="sync")
    store = ExternalStoreIndex(spec.store_blocks)
    engine = VllmEngine(replace(config), SimulatedExecutor(FaultPlan(rate=0.15, seed=4), store),
                        store=store, load_mode="sync",
                        scheduler_cls="instrumented" if instrumented else None,
                        kvmetrics_settings={"metrics_addr": "127.0.0.1:0", "model_name": "m"})
    recovery = _RecoveryLog()
    vllm_log = logging.getLogger("vllm.v1.core.sched.scheduler")
    vllm_log.addHandler(recovery)
    try:
        for tokens in spec.warm:
            for h in engine.block_hashes(list(tokens)):
                store.insert(h)
        sched = engine.scheduler
        oracle = _Oracle(sched)
        decisions: list[dict[str, int]] = []
        pending = sorted(spec.requests, key=lambda r: r.arrival_step)
        steps = 0
        while pending or engine.busy():
            if steps >= 3000:
                raise RuntimeError("workload unfinished after 3000 steps")
            while pending and pending[0].arrival_step <= steps:
                engine.add_request(pending.pop(0).make())
            if steps == 12:
                sched.reset_prefix_cache()
                oracle.observe(engine.requests)
            record = engine.step()
            if record is not None:
                decisions.append(dict(record.vllm_output.num_scheduled_tokens))
                kv_out = getattr(record.vllm_result, "kv_connector_output", None)
                oracle.figures["load_failed_blocks"] += len(
                    getattr(kv_out, "invalid_block_ids", None) or ())
            oracle.observe(engine.requests)
            steps += 1
        page = ""
        if instrumented:
            port = sched.kvmetrics_exporter.server.port
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                page = r.read().decode()
        outcomes = {rid: engine.outcome(rid) for rid in engine.requests}
        reasons = Counter(reason for reason, _ in outcomes.values() if reason is not None)
        figures = dict(oracle.figures)
        figures.update({f"finished_{k}": v for k, v in reasons.items()})
        figures["recovered_requests"] = recovery.requests
        engine.close()
        return {"error": None, "steps": steps, "outcomes": outcomes, "figures": figures,
                "decisions": decisions, "page": page}
    except Exception as e:  # noqa: BLE001 - the mutant's failure is the result
        return {"error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(limit=-4)}
    finally:
        vllm_log.removeHandler(recovery)


#: Read by this harness only (never by kvmetrics): plant a bug in kvmetrics, in this
#: process, to show the campaign catches it. ``unguard``: a hook's fault is raised into
#: vLLM instead of counted. ``no_crosscheck``: kvmetrics compares nothing with vLLM (no
#: self-check counts, the fingerprints always pass).
PLANT_ENV = "KVMETRICS_MUTATION_PLANT"
PLANTS = ("unguard", "no_crosscheck")


def plant(which: str) -> None:
    from kvmetrics.vllm import fingerprints, selfcheck, state

    if which == "unguard":
        def fault(self: Any, hook: str, problem: str | None = None,
                  turn_off: bool = True) -> None:
            raise RuntimeError(f"planted: unguarded {hook}: {problem}")

        state.InstrumentState.fault = fault  # type: ignore[method-assign]  # the planted defect
    elif which == "no_crosscheck":
        # method-assign: the planted defect, in the worker's own copy of the class.
        selfcheck.SelfChecks.compare = lambda *args: None  # type: ignore[method-assign]
        fingerprints.check_safely = lambda: fingerprints.Verification(
            fingerprints.vllm_version(), True, protect_verified=True)
    else:
        raise ValueError(f"{PLANT_ENV}={which!r}: expected one of {', '.join(PLANTS)}")


def run_both(write: Any) -> None:
    """The uninstrumented run, then the instrumented one, in this process; each result
    is handed to ``write(name, result)`` as soon as it is known, so a process that dies
    in the instrumented run still has the uninstrumented one on record."""
    planted = os.environ.get(PLANT_ENV, "")
    write("plain", run(False))
    if planted:
        plant(planted)
    write("instrumented", run(True))
