"""An engine process for multiprocess-mode tests (``python -m tests.helpers.mp_worker``).

The parent sets ``PROMETHEUS_MULTIPROC_DIR`` in the environment, so prometheus-client
is imported in multiprocess mode here.

    run ENGINE SEED OUT [STOP_AFTER]   run a seeded workload as engine label ENGINE and
        write the pipeline's counter totals to OUT (JSON). With STOP_AFTER, write them
        after that many steps, write every value to the files (what a SIGKILL
        loses is the updates since the last flush), print "checkpoint" and block until
        killed.
    render OUT                         write the scrape page this process would serve.
"""

from __future__ import annotations

import json
import os
import random
import sys

from kvmetrics.exporters import mmap_space
from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.engine import Rig
from tests.helpers.workload import drive, random_workload, rig_for


def _dump(pipeline: MetricsPipeline, out: str) -> None:
    rows = [[name, list(values), value] for (name, values), value
            in pipeline.totals.series().items()]
    with open(out, "w") as f:
        json.dump(rows, f)
    gauges = pipeline._last_gauges  # what this engine last exported
    with open(out + ".gauges.json", "w") as f:
        json.dump([] if gauges is None else
                  [[spec.name, list(values), value] for spec, values, value in gauges.samples()],
                  f)


def run(engine: str, seed: int, out: str, stop_after: int | None) -> None:
    sink = PrometheusSink()
    assert sink.multiprocess, "PROMETHEUS_MULTIPROC_DIR must be set"
    pipeline = MetricsPipeline([sink], engine=engine, strict=True)
    workload = random_workload(random.Random(seed), n_requests=20, load_mode="mixed",
                               fault_rate=0.3, policy="recompute")
    rig = rig_for(workload, pipeline)

    def after_step(r: Rig) -> None:
        if stop_after is not None and len(r.trace) == stop_after:
            _dump(pipeline, out)
            mmap_space.flush()
            print("checkpoint", flush=True)
            sys.stdin.readline()  # wait here, mid-run, until the parent kills us
            os._exit(3)

    drive(workload, rig, after_step=after_step)
    _dump(pipeline, out)


def render(out: str) -> None:
    with open(out, "wb") as f:
        f.write(PrometheusSink().render())


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "run":
        run(args[0], int(args[1]), args[2], int(args[3]) if len(args) > 3 else None)
    elif command == "render":
        render(args[0])
    else:
        raise SystemExit(f"unknown command {command!r}")
