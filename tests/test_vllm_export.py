"""The instrumented scheduler's own export: endpoint, settings, promtool, fault handling."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from kvmetrics.lab.engine.executor import SimulatedExecutor
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan, ScriptedFailure
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.lab.engine.tokens import ExplicitTokens
from kvmetrics.lab.vllm import builder
from kvmetrics.lab.vllm.engine import VllmEngine
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import StepEvents
from kvmetrics.metrics.guard import CounterViolationError
from kvmetrics.vllm.exporting import (
    DEFAULT_METRICS_ADDR,
    endpoint_for,
    settings_for,
)

pytestmark = [pytest.mark.prometheus, pytest.mark.vllm]

PROMPT = list(range(1000, 1064))
CONFIG = SchedulerConfig(block_size=16, num_gpu_blocks=64, max_num_seqs=8,
                         max_num_batched_tokens=256, max_model_len=512)


def failing_engine(settings: dict) -> VllmEngine:
    """The foundation scenario (block #1 of a 48-token sync load fails), exporting itself."""
    store = ExternalStoreIndex(16)
    engine = VllmEngine(CONFIG, SimulatedExecutor(FaultPlan(scripted=(ScriptedFailure(1),)),
                                                  store),
                        store=store, kvmetrics_settings=settings)
    for h in engine.block_hashes(PROMPT)[:3]:
        store.insert(h)
    engine.add_request(Request("r", ExplicitTokens(PROMPT), 4))
    return engine


def test_scrape_page_passes_promtool_and_binds_loopback() -> None:
    engine = failing_engine({"metrics_addr": "127.0.0.1:0", "model_name": "opt-test"})
    exporter = engine.scheduler.kvmetrics_exporter
    try:
        assert exporter.server is not None
        assert exporter.server.host == "127.0.0.1"
        engine.run()
        url = f"http://127.0.0.1:{exporter.server.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            page = resp.read()
    finally:
        engine.close()
    assert exporter.server is None  # scheduler.shutdown() stopped the endpoint
    text = page.decode()
    assert ('kvmetrics_rolled_back_tokens_total{engine="0",mode="sync",model_name="opt-test",'
            'policy="recompute"} 32.0') in text
    assert 'kvmetrics_recomputed_tokens_total{cause="kv_load_failure",engine="0"' in text
    assert re.search(r'kvmetrics_build_info\{[^}]*engine_kind="vllm"[^}]*recovery="vllm"', text)
    check = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True,
                           timeout=60)
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()


def test_the_build_info_says_which_replicas_run_the_protective_recovery() -> None:
    """Where the fix is verified for this vLLM; elsewhere (0.28 to 0.31 are verified for
    the metrics only) the scheduler refuses to start with the fix on, in one line."""
    from kvmetrics.vllm import fingerprints

    refusal = fingerprints.protect_allowed(fingerprints.check_safely())
    if refusal is not None:
        with pytest.raises(RuntimeError) as caught:
            failing_engine({"metrics_addr": "127.0.0.1:0", "recovery": "evict"})
        assert str(caught.value) == refusal and "\n" not in refusal
        return
    engine = failing_engine({"metrics_addr": "127.0.0.1:0", "recovery": "evict"})
    exporter = engine.scheduler.kvmetrics_exporter
    try:
        engine.run()
        url = f"http://127.0.0.1:{exporter.server.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    finally:
        engine.close()
    (line,) = [row for row in text.splitlines() if row.startswith("kvmetrics_build_info{")]
    assert 'recovery="evict"' in line and line.endswith(" 1.0")


@pytest.mark.parametrize("settings, message", [
    ({"recovry": "evict"}, "additional_config.kvmetrics: unknown setting 'recovry' (known: "),
    ({"recovery": "evcit"}, "KVMETRICS_RECOVERY must be one of vllm, evict, got 'evcit'"),
])
def test_a_misspelt_setting_stops_the_scheduler_with_one_line(settings: dict,
                                                               message: str) -> None:
    with pytest.raises(ValueError) as caught:
        failing_engine(settings)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def _vllm_config(dp_index: int = 0, extra: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=dp_index),
        model_config=SimpleNamespace(served_model_name=None, model="/models/opt"),
        additional_config={"kvmetrics": extra} if extra else {})


def test_settings_defaults_env_and_additional_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    s = settings_for(_vllm_config(), env={})
    assert s.metrics_addr == DEFAULT_METRICS_ADDR == "127.0.0.1:9401"
    assert (s.model_name, s.engine, s.strict, s.export) == ("/models/opt", "0", False, True)
    assert endpoint_for(s) == ("127.0.0.1", 9401)
    # Data parallel: rank r serves base + r and labels itself engine=r.
    s = settings_for(_vllm_config(dp_index=3), env={"KVMETRICS_METRICS_ADDR": "0.0.0.0:9500"})
    assert endpoint_for(s) == ("0.0.0.0", 9503) and s.engine == "3"
    env = {"KVMETRICS_MODEL_NAME": "m", "KVMETRICS_ENGINE": "e7", "KVMETRICS_STRICT": "1",
           "KVMETRICS_OTLP_ENDPOINT": "http://127.0.0.1:4318", "KVMETRICS_METRICS_ADDR": "off"}
    s = settings_for(_vllm_config(), env=env)
    assert (s.model_name, s.engine, s.strict, s.otlp_endpoint, s.metrics_addr) == \
        ("m", "e7", True, "http://127.0.0.1:4318", None)
    s = settings_for(_vllm_config(extra={"engine": "x", "strict": False}), env=env)
    assert (s.engine, s.strict) == ("x", False)
    # A shared multiprocess directory: no endpoint of our own unless asked for.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/nonexistent")
    assert settings_for(_vllm_config(), env={}).metrics_addr is None


def test_a_long_model_path_starts_the_engine_labelled_by_its_repository(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 28, case 1: no KVMETRICS_MODEL_NAME, and vLLM serving a Hugging Face snapshot
    (its served model name is then the path, here 200+ characters): the scheduler starts,
    and the label is the repository id, as `vllm serve ORG/NAME` would have it."""
    snapshot = (tmp_path / "huggingface" / "hub" / ("models--acme-research--" + "m" * 60)
                / "snapshots" / ("0e9e39f249a16976918f6564b8830bc894c89659" * 2))
    snapshot.mkdir(parents=True)
    real = builder.model_dir(2048)
    (snapshot / "config.json").write_text(Path(real, "config.json").read_text())
    monkeypatch.setattr(builder, "model_dir", lambda _length: str(snapshot))
    monkeypatch.delenv("KVMETRICS_MODEL_NAME", raising=False)
    assert len(str(snapshot)) > 200
    engine = failing_engine({"metrics_addr": "127.0.0.1:0"})
    try:
        engine.run()
        port = engine.scheduler.kvmetrics_exporter.server.port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        engine.close()
    assert f'model_name="acme-research/{"m" * 60}"' in text
    assert 'kvmetrics_rolled_back_tokens_total{engine="0",mode="sync"' in text


def test_a_long_path_outside_the_hub_is_shortened_with_a_hash() -> None:
    path = "/mnt/" + "checkpoints/" * 12 + "run-42/step-12000"
    config = _vllm_config()
    config.model_config = SimpleNamespace(served_model_name=[path], model=path)
    name = settings_for(config, env={}).model_name
    assert len(name) <= 128 and name.startswith("...") and "/run-42/step-12000~" in name
    assert settings_for(config, env={}).model_name == name  # stable
    config.model_config = SimpleNamespace(served_model_name="chat\u202emodel", model=path)
    assert settings_for(config, env={}).model_name == "chat\\u202emodel"


@pytest.mark.parametrize(("env", "needle"), [
    ({"KVMETRICS_MODEL_NAME": "m" * 200}, "is 200 characters long (at most 128)"),
    ({"KVMETRICS_MODEL_NAME": "evil\u202egnp"}, "contains U+202E"),
    ({"KVMETRICS_ENGINE": "e\n1"}, "contains U+000A"),
])
def test_an_explicit_unusable_label_value_still_refuses_the_start(
        env: dict, needle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError) as caught:
        failing_engine({"metrics_addr": "127.0.0.1:0"})
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_metric_faults_never_reach_vllm() -> None:
    engine = failing_engine({"metrics_addr": "off"})
    sched = engine.scheduler
    pipeline = sched.kvmetrics_pipeline

    class Broken:
        def __getattr__(self, name: str):
            raise RuntimeError("kvmetrics is broken")

    pipeline.add_sink(Broken())  # an exporter that raises on every call
    bad = StepEvents(step=0)
    bad.count(cat.ROLLED_BACK_TOKENS, -5, "sync", "recompute", request_id="r")
    sched.kvmetrics_merge(bad)
    engine.step()  # the recovery step: counted, the negative increment refused
    assert [v.kind for v in pipeline.violations] == ["negative"]
    assert pipeline.totals.get(cat.GUARD_REJECTED_INCREMENTS, reason="negative") == 1
    assert pipeline.totals.get(cat.ROLLED_BACK_TOKENS) == 32
    sched._kv = Broken()  # from now on every hook faults inside kvmetrics
    engine.run()
    engine.close()
    assert engine.outcome("r")[0] == "length"  # vLLM carried on regardless


def test_strict_mode_raises_counter_violations() -> None:
    engine = failing_engine({"metrics_addr": "off", "strict": True})
    bad = StepEvents(step=0)
    bad.count(cat.ROLLED_BACK_TOKENS, -5, "sync", "recompute", request_id="r")
    engine.scheduler.kvmetrics_merge(bad)
    with pytest.raises(CounterViolationError, match="negative"):
        engine.step()
    engine.close()


def test_multiprocess_dir_is_shared_with_vllms_api_server(tmp_path) -> None:
    """With PROMETHEUS_MULTIPROC_DIR the values land where vLLM's /metrics reads them."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from test_vllm_export import failing_engine
        engine = failing_engine({{}})
        assert engine.scheduler.kvmetrics_exporter.server is None
        engine.run()
        engine.close()
    """)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), VLLM_TARGET_DEVICE="cpu",
               HF_HUB_OFFLINE="1")
    env.pop("KVMETRICS_METRICS_ADDR", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    page = generate_latest(registry).decode()
    assert 'kvmetrics_rolled_back_tokens_total{engine="0"' in page
    assert json.dumps("recompute") in page


def test_builder_accepts_the_scheduler_cls_path() -> None:
    sched = builder.build_scheduler(CONFIG, scheduler_cls=builder.INSTRUMENTED_ASYNC,
                                    kvmetrics_settings={"export": False})
    assert type(sched).__name__ == "InstrumentedAsyncScheduler"
    assert sched.kvmetrics_pipeline is None
    sched.shutdown()
