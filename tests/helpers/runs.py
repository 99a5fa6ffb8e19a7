"""A varied engine run for exporter tests, in phases (scrapes can be awaited in between).

Between them the phases move every counter family the reference engine feeds, the
violations counter included: sync loads with preemption under ``fail``, mixed sync and
async loads under ``recompute``, then the historical-accounting scenario whose negative
increment the guard refuses.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.scenarios import preemption_before_first_output
from tests.helpers.workload import Workload, drive, random_workload, rig_for

STORED = (6, 4, 2)


def exporter_workloads() -> tuple[Workload, Workload]:
    first = random_workload(random.Random("exporters-1"), n_requests=30, load_mode="sync",
                            policy="fail", num_gpu_blocks=14, block_size=8, fault_rate=0.3,
                            stored_prefix_blocks=STORED)
    # No local prefix cache: every shared prefix goes through the connector.
    second = random_workload(random.Random("exporters-2"), n_requests=30, load_mode="mixed",
                             policy="recompute", block_size=16, fault_rate=0.3,
                             stored_prefix_blocks=STORED, prefix_caching=False)
    return first, second


def exporter_phases(pipeline: MetricsPipeline) -> list[Callable[[], None]]:
    """Each phase runs one engine to completion, recording into ``pipeline``."""
    if pipeline.strict:
        raise ValueError("the last phase makes a violation on purpose: use strict=False")

    def workload_phase(workload: Workload) -> Callable[[], None]:
        return lambda: drive(workload, rig_for(workload, pipeline))

    def historical() -> None:
        preemption_before_first_output("historical", pipeline).run()

    return [*(workload_phase(w) for w in exporter_workloads()), historical]


def exporter_run(pipeline: MetricsPipeline) -> None:
    for phase in exporter_phases(pipeline):
        phase()
