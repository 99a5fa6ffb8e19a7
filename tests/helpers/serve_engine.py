"""An engine process for the ``serve`` mode tests (``python -m tests.helpers.serve_engine``).

    MODE ADDR SEED [CERT KEY CA]
                     build the vLLM integration's exporter with ``serve=MODE`` on ADDR,
                     run a seeded workload through it, print one JSON line (the port,
                     the exporter process's pid, the files' directory, the totals), then
                     wait: the line ``more`` runs another seeded workload and prints
                     the totals (one JSON list); ``shutdown`` shuts the exporter down and
                     prints ``done``; EOF exits without any shutdown (as a killed engine
                     would).
                     With CERT KEY CA it serves mutual TLS.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys

from kvmetrics.exporters import mmap_space
from kvmetrics.exporters.prometheus import TLSOptions
from kvmetrics.vllm.exporting import ExportSettings, build_exporter
from tests.helpers.workload import drive, random_workload, rig_for


def main(mode: str, addr: str, seed: int, tls_files: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    tls = TLSOptions(*tls_files) if tls_files else None
    exporter = build_exporter(ExportSettings(metrics_addr=addr, serve=mode, strict=True,
                                             tls=tls))
    rng = random.Random(seed)

    def run_workload() -> list[list[object]]:
        workload = random_workload(rng, n_requests=20, load_mode="mixed", fault_rate=0.3,
                                   policy="recompute")
        drive(workload, rig_for(workload, exporter.pipeline))
        mmap_space.flush()  # every value in the files before a test reads them
        return [[name, list(values), value] for (name, values), value
                in exporter.pipeline.totals.series().items()]

    totals = run_workload()
    child = exporter.serve_process
    port = child.settings.port if child else exporter.server.port if exporter.server else None
    print(json.dumps({"port": port, "child": child.pid if child else None,
                      "dir": os.environ.get("PROMETHEUS_MULTIPROC_DIR"),
                      "totals": totals}), flush=True)
    for line in sys.stdin:
        if line.strip() == "more":
            print(json.dumps(run_workload()), flush=True)
        if line.strip() == "shutdown":
            exporter.shutdown()
            print("done", flush=True)
    os._exit(0)  # as a process that ends without its hooks


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
