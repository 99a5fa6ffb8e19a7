"""Concurrent scrapes while a lab run goes on: none fails, and the last equals the totals."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import free_port
from kvmetrics.lab.config import LabConfig
from kvmetrics.lab.runner import LabResult, run_lab
from kvmetrics.metrics import catalogue as cat

SCRAPERS = 4
MAX_SCRAPES = 4000  # bounded in count ...
DEADLINE_S = 60.0  # ... and in time; loopback only


def _counters(page: str) -> dict[tuple[str, tuple[str, ...]], float]:
    out = {}
    for family in text_string_to_metric_families(page):
        spec = cat.BY_NAME.get(family.name + "_total")
        if spec is None:
            continue
        own = (*spec.labels, *spec.open_labels)
        for sample in family.samples:
            if sample.name == spec.name and sample.value:
                out[(spec.name, tuple(sample.labels[k] for k in own))] = sample.value
    return out


def test_concurrent_scrapes_during_a_run() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    finished = threading.Event()
    results: list[LabResult] = []
    errors: list[str] = []
    pages_after_finish: list[str] = []
    count = [0]
    lock = threading.Lock()
    deadline = time.monotonic() + DEADLINE_S

    def scrape() -> None:
        served = False
        while time.monotonic() < deadline:
            with lock:
                if count[0] >= MAX_SCRAPES:
                    return
                count[0] += 1
            done_before = finished.is_set()
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    page = response.read().decode()
                    assert response.status == 200
                served = True
            except urllib.error.HTTPError as e:
                # Over the endpoint's request rate the answer is 429 at once (never a
                # queue): a scraper waits and asks again; any other status is an error.
                if e.code != 429:
                    errors.append(repr(e))
                time.sleep(0.05)
                continue
            except OSError as e:
                if served:  # refusals before the server is up are expected
                    errors.append(repr(e))
                time.sleep(0.005)
                continue
            if done_before:
                pages_after_finish.append(page)
                return

    cfg = LabConfig(verify="off", fault_rate=0.1, max_requests=300, progress=False,
                    serve=f"127.0.0.1:{port}", linger=3.0, realtime=True, step_seconds=0.004)
    lab = threading.Thread(target=lambda: results.append(
        run_lab(cfg, on_finished=lambda r: finished.set())))
    scrapers = [threading.Thread(target=scrape) for _ in range(SCRAPERS)]
    lab.start()
    for t in scrapers:
        t.start()
    for t in scrapers:
        t.join(timeout=DEADLINE_S + 5)
    lab.join(timeout=DEADLINE_S + 5)

    assert errors == []
    assert count[0] > 50, "the scrapers hardly ran"
    assert len(pages_after_finish) == SCRAPERS
    totals = results[0].pipeline.totals.series()
    for page in pages_after_finish:
        assert _counters(page) == totals
