"""The Prometheus exporter: the scrape page, the endpoint, TLS and multiprocess mode."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.parser import text_string_to_metric_families

from kvmetrics.exporters.prometheus import PrometheusSink, parse_host_port, serve
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.metrics import counters_from_page, pipeline_counters
from tests.helpers.runs import exporter_phases

pytestmark = pytest.mark.prometheus

REPO = Path(__file__).resolve().parent.parent


def _promtool_check(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)


@dataclass
class RunPages:
    pipeline: MetricsPipeline
    healthy: str  # the page before the phase that makes a violation
    final: str


@pytest.fixture(scope="module")
def run_pages() -> RunPages:
    """A varied run (failures, preemptions, then a violation) and the pages it leaves."""
    sink = PrometheusSink(CollectorRegistry())
    pipeline = MetricsPipeline([sink], model_name="opt-125m", engine="3")
    *clean, violating = exporter_phases(pipeline)
    for phase in clean:
        phase()
    healthy = generate_latest(sink.registry).decode()
    logging.disable(logging.ERROR)  # the violation is logged on purpose
    try:
        violating()
    finally:
        logging.disable(logging.NOTSET)
    return RunPages(pipeline, healthy, generate_latest(sink.registry).decode())


def test_healthy_page_passes_promtool_check_metrics(run_pages: RunPages) -> None:
    assert "kvmetrics_kv_load_failed_requests_total{" in run_pages.healthy
    result = _promtool_check(run_pages.healthy)
    assert result.returncode == 0, result.stdout + result.stderr
    # The same check does reject a bad page (a name with a colon, no help text).
    assert _promtool_check("# TYPE kvmetrics:bad counter\nkvmetrics:bad 1\n").returncode != 0


def test_page_with_rejected_increments_passes_promtool_check_metrics(
    run_pages: RunPages,
) -> None:
    assert 'reason="negative"} 1.0' in run_pages.final
    result = _promtool_check(run_pages.final)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (result.stdout + result.stderr).strip() == ""


def test_page_counters_equal_the_pipeline_totals(run_pages: RunPages) -> None:
    pipeline = run_pages.pipeline
    assert counters_from_page(run_pages.final) == pipeline_counters(pipeline)
    assert pipeline.totals.get(cat.GUARD_REJECTED_INCREMENTS, reason="negative") == 1
    assert pipeline.totals.get(cat.PREEMPTIONS) > 0
    assert pipeline.totals.get(cat.KV_LOAD_FAILED_REQUESTS, mode="async") > 0


def test_page_follows_the_catalogue(run_pages: RunPages) -> None:
    text = run_pages.final
    allowed = cat.exported_series_names()
    families = list(text_string_to_metric_families(text))
    for family in families:
        for s in family.samples:
            assert s.name in allowed, s.name  # no _created sample either
            assert ":" not in s.name
            assert (s.labels["model_name"], s.labels["engine"]) == ("opt-125m", "3")
            spec = cat.BY_NAME.get(s.name) or cat.BY_NAME[family.name]
            for label, values in spec.labels.items():
                assert s.labels[label] in values, (s.name, label)
            assert "request" not in " ".join(s.labels)
    # Every family the run touched is documented on the page.
    assert all(f.documentation for f in families)
    usage = [s for f in families for s in f.samples if s.name == cat.KV_CACHE_USAGE.name]
    assert usage and all(0.0 <= s.value <= 1.0 for s in usage)
    buckets = [s for f in families for s in f.samples
               if s.name == "kvmetrics_recovery_duration_seconds_bucket"]
    assert {s.labels["le"] for s in buckets} == {
        *(str(float(b)) for b in cat.RECOVERY_BUCKETS), "+Inf"}
    inf = next(s for s in buckets if s.labels["le"] == "+Inf")
    assert inf.value >= 1  # the recovery path ran


def test_server_binds_loopback_by_default_and_serves_the_page() -> None:
    sink = PrometheusSink(CollectorRegistry())
    MetricsPipeline([sink])
    server = serve(sink.registry, port=0)
    try:
        assert server.host == "127.0.0.1"
        assert server.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics",
                                    timeout=10) as response:
            body = response.read().decode()
        assert response.status == 200
        assert 'kvmetrics_build_info{engine="0",engine_kind="reference"' in body
    finally:
        server.stop()


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:9400", ("127.0.0.1", 9400)),
    ("[::1]:0", ("::1", 0)),
    (":9400", ("127.0.0.1", 9400)),
    ("0.0.0.0:80", ("0.0.0.0", 80)),
])
def test_listen_address_parsing(text: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(text) == expected


@pytest.mark.parametrize("text", ["9400", "host:", "host:port", "host:70000", "host:-1"])
def test_bad_listen_addresses_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT|out of range"):
        parse_host_port(text)


# -- multiprocess mode ---------------------------------------------------------------


def _worker(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.mp_worker", *args], cwd=REPO,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _totals(path: Path) -> dict:
    rows = json.loads(path.read_text())
    return {(name, tuple(values)): value for name, values, value in rows if value}


def test_multiprocess_mode_sums_engines_and_drops_a_killed_process_gauges(
    tmp_path: Path,
) -> None:
    mpdir = tmp_path / "multiproc"
    mpdir.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mpdir),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                       os.environ.get("PYTHONPATH")]))}
    out = {e: tmp_path / f"engine-{e}.json" for e in ("0", "1", "2")}
    finishing = [_worker(env, "run", e, seed, str(out[e])) for e, seed in (("0", "11"),
                                                                         ("1", "12"))]
    killed = _worker(env, "run", "2", "13", str(out["2"]), "15")
    try:
        assert killed.stdout is not None
        assert killed.stdout.readline().strip() == "checkpoint"
        os.kill(killed.pid, signal.SIGKILL)
        assert killed.wait(timeout=30) == -signal.SIGKILL
        for proc in finishing:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
    finally:
        for proc in (*finishing, killed):
            if proc.poll() is None:
                proc.kill()
    mark_process_dead(killed.pid, str(mpdir))

    rendered = tmp_path / "page.txt"
    render = _worker(env, "render", str(rendered))
    _, err = render.communicate(timeout=120)
    assert render.returncode == 0, err
    page = rendered.read_text()

    expected = {e: _totals(out[e]) for e in out}
    for engine, totals in expected.items():
        assert totals, f"engine {engine} counted nothing"
        assert counters_from_page(page, engine=engine) == totals
    everything: dict = {}
    for totals in expected.values():
        for key, value in totals.items():
            everything[key] = everything.get(key, 0) + value
    assert counters_from_page(page) == everything

    # Gauges are an engine's current state: the killed process's are gone, and so are
    # those of the engines that finished (each marked itself dead at exit).
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(mpdir))
    labels = {"model_name": "default", "state": "running"}
    for engine in ("0", "1", "2"):
        assert registry.get_sample_value("kvmetrics_requests", {**labels, "engine": engine}) \
            is None
    result = _promtool_check(page)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_family_marked_absent_while_running_leaves_the_page_and_the_totals() -> None:
    """A hook that fails at run time takes its families off the page: no sample left
    (not frozen at the last value), the family's HELP kept as for one absent from the
    start; the other families and the other engine sharing the sink keep theirs."""
    from kvmetrics.metrics.events import GaugeReadings, StepEvents

    sink = PrometheusSink()
    engines = [MetricsPipeline([sink], engine=e, engine_kind="vllm") for e in ("0", "1")]
    for pipeline in engines:
        events = StepEvents(step=1)
        events.count(cat.PREEMPTIONS, 2, request_id="r")
        events.count(cat.EVICTED_BLOCKS, 3, "capacity")
        events.gauges = GaugeReadings(0.5, 1, 2, 0, 100)
        pipeline.record(events)
    engines[0].mark_absent({cat.PREEMPTIONS.name, cat.KV_CACHE_USAGE.name})
    page = sink.render().decode()
    samples = [line for line in page.splitlines() if not line.startswith("#")]

    def has(name: str, engine: str) -> bool:
        return any(line.startswith(name + "{") and f'engine="{engine}"' in line
                   for line in samples)

    assert not has(cat.PREEMPTIONS.series_names()[0], "0")
    assert not has(cat.KV_CACHE_USAGE.name, "0")
    assert f"# HELP {cat.PREEMPTIONS.series_names()[0]}" in page
    assert has(cat.EVICTED_BLOCKS.series_names()[0], "0") and has(cat.REQUESTS.name, "0")
    assert has(cat.PREEMPTIONS.series_names()[0], "1") and has(cat.KV_CACHE_USAGE.name, "1")
    assert engines[0].totals.get(cat.PREEMPTIONS) == 0
    assert engines[0].totals.get(cat.EVICTED_BLOCKS) == 3
    again = StepEvents(step=2)
    again.count(cat.PREEMPTIONS, 1, request_id="r")
    engines[0].record(again)  # counted no more
    assert not [line for line in sink.render().decode().splitlines()
                if line.startswith(cat.PREEMPTIONS.series_names()[0] + "{")
                and 'engine="0"' in line]


def test_each_value_file_event_is_counted_under_its_own_reason() -> None:
    """A failed repair was counted as a repair, and a series kept in memory only was
    not counted at all."""
    sink = PrometheusSink(CollectorRegistry())
    for what in ("truncated", "unwritable", "rewrite_failed", "series_unstored",
                 "series_unstored"):
        sink._rewrote_files(what, "counter_1.db")
    page = generate_latest(sink.registry).decode()
    counted = {s.labels["reason"]: s.value for f in text_string_to_metric_families(page)
               for s in f.samples if s.name == cat.SCRAPE_ERRORS.name + "_total"
               or s.name == cat.SCRAPE_ERRORS.name}
    assert counted == {"multiprocess_file_rewritten": 1, "multiprocess_file_unwritable": 1,
                       "multiprocess_rewrite_failed": 1, "multiprocess_series_unstored": 2}
