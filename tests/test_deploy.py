"""deploy/: files parse, generated manifests are in sync, and the pieces point at each other.

Deploy files fail late (at `docker compose up`, at `kubectl apply`, when Grafana
starts); these checks catch the usual causes early: a mount of a file that moved,
a stale generated manifest, a port that differs between the collector and the
scrape config.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
YAML_FILES = sorted([*DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")])


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _generate_module() -> ModuleType:
    """deploy/kubernetes/generate.py is a script, not a package module: load it by path."""
    path = DEPLOY / "kubernetes" / "generate.py"
    spec = importlib.util.spec_from_file_location("kvmetrics_k8s_generate", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATE = _generate_module()
COMPOSE = _load(DEPLOY / "compose.yaml")
PROMETHEUS = _load(DEPLOY / "prometheus" / "prometheus.yml")


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path: Path) -> None:
    documents = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
    assert documents and all(isinstance(doc, dict) for doc in documents)


@pytest.mark.parametrize(
    "path",
    [
        p
        for p in [*DEPLOY.rglob("*"), *(ROOT / "dashboards").rglob("*")]
        if p.is_file() and "__pycache__" not in p.parts
    ],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_machine_paths(path: Path) -> None:
    # Files are read from the repository, never from where one machine keeps it.
    assert b"/work/" not in path.read_bytes()


def test_prometheus_rule_is_generated_from_rules_yml() -> None:
    committed = GENERATE.PROMETHEUS_RULE.read_text(encoding="utf-8")
    assert committed == GENERATE.render_prometheus_rule(), "run deploy/kubernetes/generate.py"
    manifest = yaml.safe_load(committed)
    assert manifest["kind"] == "PrometheusRule"
    assert manifest["spec"]["groups"] == _load(DEPLOY / "prometheus" / "rules.yml")["groups"]


def test_dashboard_configmap_holds_the_dashboard_json() -> None:
    committed = GENERATE.DASHBOARD_CONFIGMAP.read_text(encoding="utf-8")
    assert committed == GENERATE.render_dashboard_configmap(), "run deploy/kubernetes/generate.py"
    manifest = yaml.safe_load(committed)
    assert manifest["metadata"]["labels"]["grafana_dashboard"] == "1"
    json_files = sorted((ROOT / "dashboards").glob("*.json"))
    assert json_files
    assert manifest["data"] == {p.name: p.read_text(encoding="utf-8") for p in json_files}
    for text in manifest["data"].values():
        json.loads(text)


def test_generate_check_flag() -> None:
    result = subprocess.run(
        [sys.executable, str(DEPLOY / "kubernetes" / "generate.py"), "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr


def _bind_mounts(service: dict[str, Any]) -> list[tuple[Path, str]]:
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts.append(((DEPLOY / source).resolve(), target))
    return mounts


def test_compose_references_existing_files() -> None:
    for name, service in COMPOSE["services"].items():
        for source, _ in _bind_mounts(service):
            assert source.exists(), f"{name}: {source} does not exist"
        if "build" in service:
            context = (DEPLOY / service["build"]["context"]).resolve()
            assert context.is_dir()
            assert (context / service["build"]["dockerfile"]).is_file()


def test_compose_images() -> None:
    services = COMPOSE["services"]
    assert services["grafana"]["image"].startswith("grafana/grafana:11.6")
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["lab"]["command"][:3] == ["run", "--serve", "0.0.0.0:9400"]


def test_compose_wires_prometheus_config_and_rules() -> None:
    mounts = {t: s for s, t in _bind_mounts(COMPOSE["services"]["prometheus"])}
    config_target = next(
        arg.split("=", 1)[1]
        for arg in COMPOSE["services"]["prometheus"]["command"]
        if arg.startswith("--config.file=")
    )
    assert mounts[config_target] == DEPLOY / "prometheus" / "prometheus.yml"
    for rule_file in PROMETHEUS["rule_files"]:
        target = str(Path(config_target).parent / rule_file)
        assert mounts[target] == DEPLOY / "prometheus" / "rules.yml"


def test_compose_mounts_dashboard_where_grafana_provisioning_looks() -> None:
    grafana = COMPOSE["services"]["grafana"]
    mounts = {t: s for s, t in _bind_mounts(grafana)}
    provisioning = mounts["/etc/grafana/provisioning"]
    assert provisioning == DEPLOY / "grafana" / "provisioning"
    providers = _load(provisioning / "dashboards" / "kvmetrics.yml")["providers"]
    paths = {provider["options"]["path"] for provider in providers}
    dashboards = {
        source.name: target for target, source in mounts.items() if source.suffix == ".json"
    }
    assert dashboards == {"kv-cache-recovery.json": next(iter(paths)) + "/kv-cache-recovery.json"}
    datasources = _load(provisioning / "datasources" / "prometheus.yml")["datasources"]
    assert [ds["type"] for ds in datasources] == ["prometheus"]
    assert datasources[0]["url"] == "http://prometheus:9090"
    assert "prometheus" in COMPOSE["services"]


def _targets() -> dict[str, list[str]]:
    return {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in PROMETHEUS["scrape_configs"]
    }


def test_prometheus_scrapes_lab_vllm_and_collector() -> None:
    targets = _targets()
    assert targets["kvmetrics-lab"] == ["127.0.0.1:9400"]
    assert targets["kvmetrics-vllm"] == ["127.0.0.1:9401"]
    assert targets["vllm"] == ["127.0.0.1:8000"]
    assert targets["otel-collector"] == ["127.0.0.1:8889"]
    # KVMetricsExporterDown watches job=~"kvmetrics.*": both kvmetrics endpoints must match.
    rules = _load(DEPLOY / "prometheus" / "rules.yml")
    (down,) = [
        r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "KVMetricsExporterDown"
    ]
    match = re.search(r'job=~"([^"]+)"', down["expr"])
    assert match, down["expr"]
    kvmetrics_jobs = {job for job in targets if re.fullmatch(match.group(1), job)}
    assert kvmetrics_jobs == {"kvmetrics-lab", "kvmetrics-vllm"}


def test_lab_shares_prometheus_network_in_compose() -> None:
    # prometheus.yml scrapes 127.0.0.1: that only reaches the lab and the collector
    # if they share the Prometheus container's network namespace.
    for name in ("lab", "otel-collector"):
        assert COMPOSE["services"][name]["network_mode"] == "service:prometheus"


def test_otel_collector_pipeline() -> None:
    config = _load(DEPLOY / "otel-collector" / "config.yaml")
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    exporter = config["exporters"]["prometheus"]
    assert exporter["endpoint"].endswith(":8889")
    assert exporter["add_metric_suffixes"] is True
    pipeline = config["service"]["pipelines"]["metrics"]
    assert pipeline["receivers"] == ["otlp"] and pipeline["exporters"] == ["prometheus"]
    assert set(pipeline["processors"]) <= set(config.get("processors", {}))


def test_podmonitor_jobs_match_prometheus_config() -> None:
    monitor = _load(DEPLOY / "kubernetes" / "podmonitor.yaml")
    assert monitor["kind"] == "PodMonitor"
    jobs = {
        relabel["replacement"]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]
        for relabel in endpoint.get("relabelings", [])
        if relabel.get("targetLabel") == "job"
    }
    assert jobs == {"kvmetrics-vllm", "vllm"}
    assert jobs <= set(_targets())


def test_dockerfile_installs_cpu_torch_before_the_project() -> None:
    lines = (DEPLOY / "Dockerfile").read_text(encoding="utf-8").splitlines()
    torch = next(i for i, line in enumerate(lines) if "download.pytorch.org/whl/cpu" in line)
    project = next(i for i, line in enumerate(lines)
                   if re.search(r"pip install .*\"/src\[dataplane", line))
    assert torch < project
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    assert {"!pyproject.toml", "!kvmetrics", "!scripts/constraints.txt"} <= set(ignore)


def test_soak_job_shards_cover_the_campaign(tmp_path: Path) -> None:
    """Each pod of the Indexed Job runs the container args with its completion index;
    the shards those args name, run (on a smaller campaign) and merged, equal the whole."""
    job = _load(DEPLOY / "kubernetes" / "soak-job.yaml")
    spec = job["spec"]
    assert job["kind"] == "Job" and spec["completionMode"] == "Indexed"
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["SHARD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    args = container["args"]
    assert args[0] == "soak" and "--json" in args
    (shard_arg,) = [a for a in args if a.startswith("--shard=")]
    assert shard_arg == f"--shard=$(SHARD_INDEX)/{spec['completions']}"
    assert spec["parallelism"] <= spec["completions"]
    # Run the pods' commands for a small campaign: same shard count, fewer scenarios.
    count = spec["completions"]
    small = [a if not a.startswith("--scenarios=") else "--scenarios=10" for a in args]
    # With the fix: vLLM's own recovery path can stall for good (docs/vllm-defects.md,
    # async-load-stall), which the soak rightly reports; the shards are what is tested.
    small = [a for a in small if not a.startswith("--jobs=")] + ["--verify=off",
                                                                 "--recovery=evict"]
    files = []
    for index in range(count):
        argv = [a.replace("$(SHARD_INDEX)", str(index)) for a in small]
        result = subprocess.run([sys.executable, "-m", "kvmetrics", *argv], capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        path = tmp_path / f"shard-{index}.json"
        path.write_text(result.stdout)
        files.append(str(path))
    merged = subprocess.run([sys.executable, "-m", "kvmetrics", "soak-merge", "--json", *files],
                            capture_output=True, text=True, timeout=300)
    assert merged.returncode == 0, merged.stderr
    whole_argv = [a for a in small if not a.startswith("--shard=")]
    whole = subprocess.run([sys.executable, "-m", "kvmetrics", *whole_argv],
                           capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    strip = lambda d: {k: v for k, v in d.items() if k not in ("wall_seconds", "digest")}  # noqa: E731
    assert strip(json.loads(merged.stdout)) == strip(json.loads(whole.stdout))
    assert json.loads(whole.stdout)["scenarios"] == 10
