"""A real Prometheus scrapes a mutual-TLS kvmetrics endpoint with the scrape config of
deploy/prometheus/prometheus-tls.yml (only targets and file paths replaced)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from benchmarks.tls import make_tls_material
from kvmetrics.exporters.prometheus import PrometheusSink, TLSOptions, serve
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import CounterIncrement, StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.prometheus import poll, running_prometheus

pytestmark = pytest.mark.prometheus

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"


def test_prometheus_scrapes_mutual_tls_with_the_deploy_config(tmp_path: Path) -> None:
    tls = make_tls_material(tmp_path / "tls")
    sink = PrometheusSink(CollectorRegistry())
    MetricsPipeline([sink], model_name="m", engine="0").record(
        StepEvents(1, [CounterIncrement(cat.PREEMPTIONS, 4)]))
    server = serve(sink.serving_registry(), port=0, tls=TLSOptions(
        certfile=str(tls.server_cert), keyfile=str(tls.server_key),
        client_cafile=str(tls.ca_cert)))
    config = yaml.safe_load((DEPLOY / "prometheus-tls.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kvmetrics-vllm"]
    assert job["scheme"] == "https"
    job["tls_config"].update(ca_file=str(tls.ca_cert), cert_file=str(tls.client_cert),
                             key_file=str(tls.client_key))
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{server.port}"]
    job["scrape_interval"] = job["scrape_timeout"] = "1s"
    try:
        with running_prometheus(scrape_configs=[job]) as prometheus:
            value = poll(lambda: prometheus.query_value(
                'kvmetrics_preemptions_total{job="kvmetrics-vllm",setup="vllm"}'), 30,
                "the TLS target's counter in Prometheus")
            assert value == 4
            assert prometheus.query_value('up{job="kvmetrics-vllm"}') == 1
    finally:
        server.stop()
