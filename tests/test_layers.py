"""Dependencies point one way, toward the engine-agnostic core.

Each layer may import only the layers listed for it (and the standard library
or its own third-party tools). A layer is a package of kvmetrics/ or, inside the lab, a
subpackage or module with stricter rules of its own (``lab/engine``): a file belongs to
the most specific layer that holds it. What ships into ``vllm serve`` (metrics,
exporters, vllm, faults, protect) never imports the lab or the commands; the reference
engine never imports torch, vLLM or an exporter: it is the pure core the lab builds on.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvmetrics"

#: layer -> (kvmetrics layers it may import, third-party top-level modules it may import)
ALLOWED: dict[str, tuple[set[str], set[str]]] = {
    # What ships into vllm serve.
    "metrics": ({"metrics"}, set()),
    "exporters": ({"exporters", "metrics"}, {"prometheus_client", "opentelemetry"}),
    # The observer. protect: the scheduler composes the opt-in fix into its class (only
    # the scheduler imports it, test below); never the fault connector.
    "vllm": ({"vllm", "protect", "metrics", "exporters"}, {"vllm"}),
    # Loaded by vLLM's connector factory, in the workers too: never the observer.
    "faults": ({"faults", "metrics"}, {"vllm", "torch"}),
    # Runs inside the observer's class: its hook table, fingerprints and logger.
    "protect": ({"protect", "vllm", "metrics"}, {"vllm"}),
    # The lab. Not "lab/vllm": engines register through an entry point (test below).
    # torch: the demo model's weights (lab/demo_model.py), drawn like the data plane's.
    # lab/kv_errors.py: telling the data plane's strict stop apart without importing torch.
    "lab": ({"lab", "lab/engine", "lab/kv", "lab/kv_errors.py", "lab/instrument.py",
             "metrics", "exporters"}, {"rich", "matplotlib", "torch"}),
    "lab/engine": ({"lab/engine", "metrics"}, set()),
    "lab/kv": ({"lab/kv", "lab/engine", "metrics"}, {"torch", "numpy"}),
    "lab/kv_errors.py": (set(), set()),
    "lab/instrument.py": ({"metrics"}, set()),
    # The harness around vLLM's scheduler: the lab, and the observer it drives.
    "lab/vllm": ({"lab/vllm", "lab", "lab/engine", "lab/kv", "vllm", "faults", "protect",
                  "metrics", "exporters"},
                 {"vllm", "prometheus_client", "opentelemetry", "torch"}),
    # The command is the top layer: ``kvmetrics vllm-check`` imports the vLLM canaries
    # (lazily, inside the command, so that other commands never load vLLM).
    "cli": ({"cli", "lab", "lab/engine", "metrics", "lab/kv_errors.py", "lab/vllm"}, set()),
    # The deprecated aliases of the old paths fleets type in their configurations.
    "integrations": ({"vllm", "faults"}, set()),
}
#: What ``vllm serve`` loads.
SHIPPED = ("metrics", "exporters", "vllm", "faults", "protect")
STDLIB = set(sys.stdlib_module_names)


def _layer(parts: tuple[str, ...]) -> str:
    """The most specific layer holding the module ``kvmetrics.<parts>``."""
    for depth in range(len(parts), 0, -1):
        key = "/".join(parts[:depth])
        for candidate in (key, f"{key}.py"):
            if candidate in ALLOWED:
                return candidate
    return parts[0]


def _file_layer(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return _layer(parts[:-1] if parts[-1] == "__init__" else parts)


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
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent == PACKAGE:
            continue  # kvmetrics/__init__.py and __main__.py
        layers, third_party = ALLOWED[_file_layer(path)]
        for name in _imports(path):
            top = name.split(".")[0]
            if top == "kvmetrics":
                parts = tuple(name.split(".")[1:])
                if parts and _layer(parts) not in layers | {_file_layer(path)}:
                    problems.append(f"{path.relative_to(PACKAGE)} imports {name}")
            elif top not in STDLIB and top not in third_party and top != "__future__":
                problems.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert problems == []


def test_every_package_of_kvmetrics_is_a_layer() -> None:
    """A new package gets its row in ALLOWED (and in docs/architecture.md)."""
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages <= set(ALLOWED)
    assert {_file_layer(PACKAGE / "lab" / "engine" / "scheduler.py"),
            _file_layer(PACKAGE / "lab" / "kv_errors.py"),
            _file_layer(PACKAGE / "lab" / "runner.py")} == {"lab/engine", "lab/kv_errors.py",
                                                            "lab"}


def test_importing_the_engine_loads_no_heavy_dependency() -> None:
    code = ("import sys, kvmetrics.lab.engine.scheduler, kvmetrics.lab.engine.executor, "
            "kvmetrics.lab.engine.loop, kvmetrics.metrics.pipeline; "
            "print(sorted(m for m in ('torch', 'vllm', 'prometheus_client', 'opentelemetry') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


@pytest.mark.vllm
def test_lab_engines_come_from_the_entry_point_group() -> None:
    """The vLLM lab engine is declared in pyproject.toml and found through the installed
    metadata; a reference run loads nothing of vLLM's side (the harness, the observer,
    the fault connector, the protective recovery)."""
    import tomllib

    declared = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"][
        "entry-points"]["kvmetrics.lab_engines"]
    assert declared == {"vllm": "kvmetrics.lab.vllm.lab:VllmLabEngine"}
    code = ("import sys; from kvmetrics.lab.engine_registry import engine_names, load_engine; "
            "from kvmetrics.lab.config import LabConfig; from kvmetrics.lab.runner import "
            "run_lab; run_lab(LabConfig(verify='off', max_requests=3, progress=False)); "
            "print(engine_names(), any(m.startswith(('kvmetrics.lab.vllm', 'kvmetrics.vllm', "
            "'kvmetrics.faults', 'kvmetrics.protect', 'kvmetrics.integrations')) "
            "for m in sys.modules)); "
            "print(load_engine('vllm').__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["('reference', 'vllm') False", "kvmetrics.lab.vllm.lab"]


def test_what_ships_into_vllm_serve_imports_only_the_core() -> None:
    """``kvmetrics/{metrics,exporters,vllm,faults,protect}/`` are loaded by production
    ``vllm serve`` processes: they may import each other as ALLOWED says and vLLM, never
    the lab (the data plane, the reference engine, the harness around vLLM), the
    commands or the deprecated aliases; of them only the observer's scheduler imports the
    protective recovery."""
    problems = []
    for layer in SHIPPED:
        for path in (PACKAGE / layer).rglob("*.py"):
            for name in _imports(path):
                parts = tuple(name.split("."))
                if parts[0] != "kvmetrics" or len(parts) < 2:
                    continue
                # Lazy imports inside functions count too: _imports walks the whole tree.
                if parts[1] not in SHIPPED:
                    problems.append(f"{path.relative_to(PACKAGE)} imports {name}")
                if parts[1] == "protect" and layer != "protect" \
                        and path != PACKAGE / "vllm" / "scheduler.py":
                    problems.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert problems == []


@pytest.mark.vllm
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



def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node that can run: all of them but the bodies of ``if TYPE_CHECKING:``
    (imports for type hints only, which never execute)."""
    nodes: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                   "typing.TYPE_CHECKING"):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def _import_graph() -> dict[str, set[str]]:
    """kvmetrics module -> the kvmetrics modules it imports when it runs, anywhere in
    its body (a lazy import inside a function closes a cycle as surely as one at the
    top). ``from package import name`` points at ``package.name`` when that is a
    module, else at the package; the implicit import of parent packages is left out,
    as every tool that draws import graphs leaves it out."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_cycle_through_a_lazy_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n"
              "    import b\ndef f():\n    import c\n")
    imported = {alias.name for node in _runtime_nodes(ast.parse(source))
                if isinstance(node, ast.Import) for alias in node.names}
    assert imported == {"b", "c"}


def test_no_import_cycle_anywhere_in_kvmetrics() -> None:
    graph = _import_graph()
    assert "kvmetrics.faults.fault_mirror" in graph[
        "kvmetrics.faults.connector"]  # the graph sees real edges
    assert _cycles(graph) == []


def test_benchmarks_never_import_the_tests() -> None:
    """Benchmarks are the tests' peers, not their users: what both need lives in
    ``benchmarks/`` or in kvmetrics' lab (imports inside functions count too)."""
    problems = [f"{path.name} imports {name}"
                for path in sorted((PACKAGE.parent / "benchmarks").rglob("*.py"))
                for name in _imports(path) if name.split(".")[0] == "tests"]
    assert problems == []


#: What a test module's source shows it needs -> the marker it must declare
#: (pyproject.toml lists the markers). A floor: a module that reaches vLLM only through
#: kvmetrics' own lazy imports (the lab's ``vllm`` engine) declares it by hand.
NEEDS: dict[str, re.Pattern[str]] = {
    "serve": re.compile(r"VllmServer|ServerSpec|vllm_server"),
    "vllm": re.compile(r"^\s*(import vllm\b|from vllm[ .])|kvmetrics\.lab\.vllm|helpers(\.| "
                       r"import )(vllm_overlay|series_overlay|defect_server|"
                       r"scheduler_without_hook|native_metrics_worker)", re.M),
    "prometheus": re.compile(r"promtool|helpers\.prometheus|helpers import prometheus|"
                             r"alertmanager"),
    "browser": re.compile(r"chromium"),
}


def _declared_marks(path: Path) -> set[str]:
    """The markers of a module's ``pytestmark``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return {n.attr for n in ast.walk(node.value) if isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}
    return set()


def test_every_test_module_declares_what_it_needs() -> None:
    """``pytest -m "not serve"`` and the like select by these, so a missing one would
    put a test that starts a ``vllm serve`` into the quick loop."""
    tests = PACKAGE.parent / "tests"
    missing = {}
    for path in sorted(tests.glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue  # its patterns name everything
        text = path.read_text()
        needed = {mark for mark, pattern in NEEDS.items() if pattern.search(text)}
        if path.name.startswith("test_vllm_"):
            needed.add("vllm")
        if needed - _declared_marks(path):
            missing[path.name] = sorted(needed - _declared_marks(path))
    assert missing == {}
    assert _declared_marks(tests / "test_serve_counters.py") == {"serve"}  # the reader works
