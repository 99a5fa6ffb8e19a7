"""TLS and label values through the instrumented vLLM scheduler's settings (issue 20,
points 2 and 8): ``tls_*`` in ``additional_config.kvmetrics`` or ``KVMETRICS_TLS_*``
serve mutual TLS; a bad file or label value refuses the engine start with one line."""

from __future__ import annotations

import subprocess
import urllib.request
from pathlib import Path

import pytest

from benchmarks.tls import TLSMaterial, make_tls_material
from kvmetrics.vllm.exporting import settings_for
from tests.test_vllm_export import _vllm_config, failing_engine

pytestmark = [pytest.mark.prometheus, pytest.mark.vllm]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TLSMaterial:
    return make_tls_material(tmp_path_factory.mktemp("tls"))


def _tls_settings(tls: TLSMaterial) -> dict[str, str]:
    return {"tls_cert": str(tls.server_cert), "tls_key": str(tls.server_key),
            "tls_client_ca": str(tls.ca_cert)}


def test_additional_config_tls_serves_mutual_tls(tls: TLSMaterial) -> None:
    engine = failing_engine({"metrics_addr": "127.0.0.1:0", **_tls_settings(tls)})
    server = engine.scheduler.kvmetrics_exporter.server
    try:
        engine.run()
        url = f"https://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, context=tls.client_context(), timeout=10) as r:
            page = r.read()
        with pytest.raises(OSError):
            urllib.request.urlopen(url, context=tls.client_context(with_cert=False),
                                   timeout=10).read()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read()
    finally:
        engine.close()
    assert b'kvmetrics_rolled_back_tokens_total{engine="0"' in page
    check = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True,
                           timeout=60)
    assert check.returncode == 0 and not check.stdout.strip(), check


def test_env_settings_name_the_tls_files(tls: TLSMaterial) -> None:
    env = {"KVMETRICS_TLS_CERT": str(tls.server_cert), "KVMETRICS_TLS_KEY": str(tls.server_key),
           "KVMETRICS_TLS_CLIENT_CA": str(tls.ca_cert)}
    s = settings_for(_vllm_config(), env=env)
    assert s.tls is not None and s.tls.certfile == str(tls.server_cert)
    assert s.tls.client_cafile == str(tls.ca_cert)
    assert settings_for(_vllm_config(), env={}).tls is None


@pytest.mark.parametrize(("change", "needle"), [
    ({"tls_cert": "/nonexistent/kvm.crt"}, "cannot load TLS certificate '/nonexistent/kvm.crt'"),
    ({"tls_client_ca": "/nonexistent/ca.pem"}, "cannot load client CA '/nonexistent/ca.pem'"),
    ({"tls_key": None}, "TLS needs both a certificate and a key"),
    ({"metrics_addr": "off"}, "no kvmetrics endpoint is served"),
])
def test_unusable_settings_refuse_the_engine_start_with_one_line(
        tls: TLSMaterial, change: dict, needle: str) -> None:
    settings = {"metrics_addr": "127.0.0.1:0", **_tls_settings(tls), **change}
    settings = {k: v for k, v in settings.items() if v is not None}
    with pytest.raises(ValueError) as caught:
        failing_engine(settings)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_a_truncated_key_refuses_the_start(tls: TLSMaterial, tmp_path: Path) -> None:
    key = tmp_path / "server.key"
    key.write_bytes(tls.server_key.read_bytes()[:40])
    settings = {"metrics_addr": "127.0.0.1:0", **_tls_settings(tls), "tls_key": str(key)}
    with pytest.raises(ValueError, match="cannot load TLS certificate .*server.key"):
        failing_engine(settings)


@pytest.mark.parametrize(("change", "needle"), [
    ({"model_name": "caf\udce9"}, "(KVMETRICS_MODEL_NAME) 'caf\\udce9' is not valid UTF-8"),
    ({"engine": "e" * 300}, "is 300 characters long (at most 128)"),
])
def test_unusable_label_values_refuse_the_engine_start(change: dict, needle: str) -> None:
    with pytest.raises(ValueError) as caught:
        failing_engine({"metrics_addr": "127.0.0.1:0", **change})
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_the_bound_port_is_written_for_port_zero(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    port_file = tmp_path / "port"
    monkeypatch.setenv("KVMETRICS_METRICS_PORT_FILE", str(port_file))
    engine = failing_engine({"metrics_addr": "127.0.0.1:0"})
    try:
        port = int(port_file.read_text())
        assert port == engine.scheduler.kvmetrics_exporter.server.port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert b"kvmetrics_build_info" in r.read()
    finally:
        engine.close()
