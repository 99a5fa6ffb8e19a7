"""Dependencies point one way, toward the engine-agnostic core.

Each layer may import only the layers listed for it (and the standard library
or its own third-party tools). The engine in particular never imports torch,
vLLM or an exporter: it is the pure core the other layers build on.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvmetrics"

#: layer -> (kvmetrics layers it may import, third-party top-level modules it may import)
ALLOWED: dict[str, tuple[set[str], set[str]]] = {
    "metrics": ({"metrics"}, set()),
    "engine": ({"engine", "metrics"}, set()),
    "exporters": ({"exporters", "metrics"}, {"prometheus_client", "opentelemetry"}),
    "instrument": ({"instrument", "metrics"}, set()),
    "kv": ({"kv", "engine", "metrics"}, {"torch", "numpy"}),
    # Not "integrations": engines register through an entry point (test below).
    # torch: the demo model's weights (lab/demo_model.py), drawn like the data plane's.
    # kv_errors: telling the data plane's strict stop apart without importing torch.
    "lab": ({"lab", "engine", "metrics", "exporters", "instrument", "kv", "kv_errors"},
            {"rich", "matplotlib", "torch"}),
    "integrations": ({"integrations", "lab", "engine", "metrics", "exporters", "instrument",
                      "kv"}, {"vllm", "prometheus_client", "opentelemetry", "torch"}),
    # The command is the top layer: ``kvmetrics vllm-check`` imports the vLLM canaries
    # (lazily, inside the command, so that other commands never load vLLM).
    "cli": ({"cli", "lab", "engine", "metrics", "kv_errors", "integrations"}, set()),
    "kv_errors.py": (set(), set()),
}
STDLIB = set(sys.stdlib_module_names)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_every_module_imports_only_its_allowed_layers() -> None:
    problems = []
    for layer, (layers, third_party) in ALLOWED.items():
        root = PACKAGE / layer
        for path in (root.rglob("*.py") if root.is_dir() else [root]):
            for name in _imports(path):
                top = name.split(".")[0]
                if top == "kvmetrics":
                    parts = name.split(".")
                    if len(parts) > 1 and parts[1] not in layers:
                        problems.append(f"{path.relative_to(PACKAGE)} imports {name}")
                elif top not in STDLIB and top not in third_party and top != "__future__":
                    problems.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert problems == []


def test_importing_the_engine_loads_no_heavy_dependency() -> None:
    code = ("import sys, kvmetrics.engine.scheduler, kvmetrics.engine.executor, "
            "kvmetrics.engine.loop, kvmetrics.metrics.pipeline; "
            "print(sorted(m for m in ('torch', 'vllm', 'prometheus_client', 'opentelemetry') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_lab_engines_come_from_the_entry_point_group() -> None:
    """The vLLM lab engine is declared in pyproject.toml and found through the installed
    metadata; a reference run loads no integration at all."""
    import tomllib

    declared = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"][
        "entry-points"]["kvmetrics.lab_engines"]
    assert declared == {"vllm": "kvmetrics.integrations.vllm_lab.lab:VllmLabEngine"}
    code = ("import sys; from kvmetrics.lab.engines import engine_names, load_engine; "
            "from kvmetrics.lab.config import LabConfig; from kvmetrics.lab.runner import "
            "run_lab; run_lab(LabConfig(verify='off', max_requests=3, progress=False)); "
            "print(engine_names(), any(m.startswith('kvmetrics.integrations') "
            "for m in sys.modules)); "
            "print(load_engine('vllm').__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["('reference', 'vllm') False", "kvmetrics.integrations.vllm_lab.lab"]


def test_what_ships_into_vllm_serve_imports_only_the_core() -> None:
    """``kvmetrics/integrations/vllm/`` is loaded by production ``vllm serve`` processes:
    it may import the engine-agnostic core, the exporters and vLLM, never the lab, the
    data plane, the reference engine or the lab's harness around vLLM."""
    allowed = {("kvmetrics", "metrics"), ("kvmetrics", "exporters"),
               ("kvmetrics", "integrations")}
    problems = []
    for path in (PACKAGE / "integrations" / "vllm").rglob("*.py"):
        for name in _imports(path):
            parts = tuple(name.split("."))
            if parts[0] != "kvmetrics" or len(parts) < 2:
                continue
            if parts[:2] not in allowed or parts[:3] == ("kvmetrics", "integrations",
                                                         "vllm_lab"):
                problems.append(f"{path.relative_to(PACKAGE)} imports {name}")
            # Lazy imports inside functions count too: _imports walks the whole tree.
    assert problems == []


def test_every_kvmetrics_logger_escapes_what_it_logs() -> None:
    """Each logger kvmetrics writes to carries the one-line filter (metrics/logs.py), so
    no logged value can forge or rewrite a line: checked on the loggers that exist
    once every module is imported, so a new module's plain logger is found."""
    script = (
        "import importlib, logging, pkgutil, kvmetrics\n"
        "from kvmetrics.metrics.logs import OneLineFilter\n"
        "for m in pkgutil.walk_packages(kvmetrics.__path__, 'kvmetrics.'):\n"
        "    if not m.name.endswith('__main__'):\n"
        "        importlib.import_module(m.name)\n"
        "for name, logger in sorted(logging.Logger.manager.loggerDict.items()):\n"
        "    if (name.startswith(('kvmetrics', 'vllm.kvmetrics'))\n"
        "            and isinstance(logger, logging.Logger)):\n"
        "        ok = any(isinstance(f, OneLineFilter) for f in logger.filters)\n"
        "        print(name, ok)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, check=True,
                         env={**__import__("os").environ, "VLLM_TARGET_DEVICE": "cpu"})
    rows = dict(line.split() for line in out.stdout.splitlines())
    assert "kvmetrics.http" in rows and "vllm.kvmetrics" in rows
    assert [name for name, ok in rows.items() if ok != "True"] == []

