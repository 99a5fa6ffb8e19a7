"""Run kvmetrics' in-process fault workloads on vLLM patched with 0005, and print
vLLM's own KV-load failure counters next to kvmetrics' counts (one JSON object).

Run by tests/test_upstream_metrics_patch.py in a fresh interpreter whose PYTHONPATH
puts the patched vLLM first. Each scheduler step's ``SchedulerStats`` goes through
vLLM's own ``PrometheusStatLogger`` (as the engine's frontend does), and vLLM's
counters are read back from the Prometheus registry.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import prometheus_client
from vllm.v1.metrics.loggers import PrometheusStatLogger

from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.lab.vllm import engine as engine_module
from kvmetrics.lab.vllm.differential import (
    random_workload,
    run_vllm,
    vllm_faithful,
)
from kvmetrics.metrics import catalogue as cat
from kvmetrics.vllm import native_stats

#: (load mode, policy, seed, async scheduling) of each workload. Under vLLM's
#: AsyncScheduler a request's next step may be scheduled before the failed step's output
#: is processed. Both sides take the count before the failed step as vLLM's rollback
#: does (computed count minus the step's scheduled tokens), so equal counts show they
#: count the same events, not that this count excludes a next step already scheduled.
WORKLOADS = (("sync", "recompute", 0, False), ("sync", "fail", 1, False),
             ("async", "recompute", 2, False), ("async", "fail", 3, False),
             ("mixed", "recompute", 4, False), ("sync", "recompute", 5, True),
             ("sync", "fail", 6, True), ("async", "recompute", 7, True),
             ("async", "fail", 8, True))
#: vLLM's counter -> kvmetrics' family and the labels to sum it over.
MAPPING: dict[str, tuple[cat.MetricSpec, dict[str, str]]] = {
    "vllm:kv_load_failed_blocks_total": (cat.KV_LOAD_BLOCKS, {"outcome": "failed"}),
    "vllm:kv_load_failed_requests_total": (cat.KV_LOAD_FAILED_REQUESTS, {}),
    "vllm:kv_load_rolled_back_tokens_total": (cat.ROLLED_BACK_TOKENS, {}),
    "vllm:kv_load_recomputed_tokens_total": (cat.RECOMPUTED_TOKENS,
                                             {"cause": "kv_load_failure"}),
}


class _Exported:
    """Every scheduler of the run hands its stats to one vLLM stat logger."""

    logger: PrometheusStatLogger | None = None
    scheduler: Any = None
    steps_scheduled = 0
    steps_with_stats = 0


def _export_stats(engine: Any) -> None:
    scheduler = engine.scheduler
    _Exported.logger = PrometheusStatLogger(scheduler.vllm_config, engine_indexes=[0])
    _Exported.scheduler = scheduler
    update = scheduler.update_from_output

    def update_and_export(*args: Any, **kwargs: Any) -> Any:
        outputs = update(*args, **kwargs)
        for core_outputs in outputs.values():
            if core_outputs.scheduler_stats is not None:
                assert _Exported.logger is not None
                _Exported.logger.record(core_outputs.scheduler_stats, None, engine_idx=0)
                _Exported.steps_with_stats += 1
        return outputs

    schedule = scheduler.schedule

    def count_and_schedule(*args: Any, **kwargs: Any) -> Any:
        _Exported.steps_scheduled += 1
        return schedule(*args, **kwargs)

    scheduler.update_from_output = update_and_export
    scheduler.schedule = count_and_schedule
    if engine.batch_queue is not None:  # async scheduling: it holds vLLM's schedule
        engine.batch_queue._schedule = count_and_schedule


def _vllm_counters(policy: str) -> dict[str, float]:
    found = dict.fromkeys(MAPPING, 0.0)
    for metric in prometheus_client.REGISTRY.collect():
        for sample in metric.samples:
            if sample.name in MAPPING:
                assert sample.labels == {"model_name": sample.labels["model_name"],
                                         "engine": "0", "policy": policy}, sample.labels
                found[sample.name] += sample.value
    return found


def main() -> None:
    init = engine_module.VllmEngine.__init__

    def init_and_export(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _export_stats(self)

    engine_module.VllmEngine.__init__ = init_and_export  # type: ignore[method-assign]
    results = {}
    for mode, policy, seed, async_scheduling in WORKLOADS:
        scheduling = "async_scheduling" if async_scheduling else "sync_scheduling"
        results[f"{scheduling}-{mode}-{policy}"] = _run(mode, policy, seed, async_scheduling)
    # kvmetrics' run-time comparison with these figures, shown able to fail: vLLM's
    # failed-block figure off by one on every step that has failed blocks.
    read = native_stats._read

    def off_by_one(outputs: Any) -> list[int] | None:
        figures = read(outputs)
        if figures and figures[0]:
            figures[0] += 1
        return figures

    native_stats._read = off_by_one
    results["mutated-sync-recompute"] = _run("sync", "recompute", 5, False)

    def unreadable(outputs: Any) -> list[int]:
        raise AttributeError("kv_load_failure_stats")

    native_stats._read = unreadable  # the comparison stops, counted once
    results["unreadable-sync-recompute"] = _run("sync", "recompute", 5, False)
    json.dump(results, sys.stdout)


def _run(mode: str, policy: str, seed: int, async_scheduling: bool) -> dict[str, Any]:
    config = vllm_faithful(SchedulerConfig(
        block_size=16, num_gpu_blocks=1024, max_num_seqs=8, max_num_batched_tokens=128,
        max_model_len=1024, kv_load_failure_policy=policy,  # type: ignore[arg-type]
        async_scheduling=async_scheduling))
    _Exported.steps_scheduled = _Exported.steps_with_stats = 0
    run = run_vllm(config, random_workload(seed, 60, load_mode=mode, doc_blocks=(2, 6)),
                   FaultPlan(rate=0.15, seed=seed))
    totals = run.pipeline.totals
    return {
        "steps_scheduled": _Exported.steps_scheduled,
        "steps_with_stats": _Exported.steps_with_stats,
        "vllm": _vllm_counters(policy),
        "kvmetrics": {name: totals.get(spec, **labels)
                      for name, (spec, labels) in MAPPING.items()},
        # kvmetrics compared its counts with vLLM's at every recorded step.
        "compared": _Exported.scheduler._kv.native_load,
        "check_failures": totals.get(cat.SELF_CHECK_FAILURES, check=native_stats.CHECK),
    }


if __name__ == "__main__":
    main()
