"""Which vLLM code can change a kvmetrics figure, and a hash of each piece that ignores form.

The set is derived, not listed by hand, so that a function nobody thought of is covered:

1. the roots: the modules of the classes whose methods the hook table
   (:data:`.hooks.HOOKS`, :data:`.hooks.ATTRIBUTES`) hooks or reads, with the modules of
   their vLLM base classes, and every vLLM module the instrumented scheduler's own code
   imports (found by parsing the source of this package and of :mod:`kvmetrics.protect`,
   which the scheduler composes in; the fault-injecting connector, :mod:`kvmetrics.faults`,
   is left out: it injects, it does not count);
2. the closure: every module a covered module imports that lies inside the package of a
   hooked class (``vllm.v1.core``, ``vllm.v1.core.sched``, the v1 connector package), so
   the helpers the hooked methods call (the coordinator, the request queues, the
   single-type managers) are in.

Each module then contributes one entry per function, method and class
(``module:Qualified.name``) and one for its module-level statements (``module:<module>``).
An entry's hash is sha256 of ``ast.dump`` of its node without docstrings; a class's node
leaves its methods and nested classes out (they have their own entries), so a changed
method names that method only. Comments, blank lines, quotes and line wrapping are not in
the AST: reformatting changes no hash, any change of code does.

A comparison first hashes each module file's bytes (:func:`file_digest`, recorded with the
entries): only a module whose bytes differ from the record is parsed. Parsed hashes are
cached in memory by the file's (path, size, mtime).
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

#: The hook table's owners (``hooks.OWNERS`` and the attributes' owners), as the vLLM
#: class each one is an instance of. A test keeps the keys equal to the owners in use.
OWNER_CLASSES: dict[str, str] = {
    "scheduler": "vllm.v1.core.sched.scheduler:Scheduler",
    "kv_cache_manager": "vllm.v1.core.kv_cache_manager:KVCacheManager",
    "block_pool": "vllm.v1.core.block_pool:BlockPool",
    "connector": "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1",
    "kv_connector_output": "vllm.v1.outputs:KVConnectorOutput",
}
#: The packages whose code is the counting path: the observer and the protective recovery
#: it composes in (kvmetrics/faults/ injects, it does not count).
_COUNTING_DIRS = (Path(__file__).parent, Path(__file__).parent.parent / "protect")
#: The closure stays inside the packages of roots at least this deep: the data-holding
#: roots (``vllm.v1.outputs``, ``vllm.v1.request``) are covered themselves, but their
#: package (``vllm.v1``, most of vLLM) is too wide to close over.
_CLOSE_OVER_DEPTH = 3
MODULE_ENTRY = "<module>"

_cache: dict[tuple[str, int, int], dict[str, str]] = {}


def _import_target(target: str) -> object:
    module_name, _, qualname = target.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _counting_path_imports(package_dirs: Iterable[Path]) -> set[str]:
    """The vLLM modules the instrumented scheduler's code imports."""
    found: set[str] = set()
    for package_dir in package_dirs:
        for path in sorted(package_dir.glob("*.py")):
            found |= imports(path.read_bytes())
    return found


#: ``from vllm.x import ...`` and ``import vllm.x`` at any indentation. A regular
#: expression, not a parse: it reads a 4000-line module in a millisecond, and vLLM writes
#: its imports one per statement, absolute.
_IMPORT = re.compile(rb"^[ \t]*(?:from[ \t]+(vllm(?:\.\w+)+)[ \t]+import\b"
                     rb"|import[ \t]+(vllm(?:\.\w+)+))", re.MULTILINE)


def imports(source: bytes) -> set[str]:
    """The ``vllm.*`` modules a module's source imports."""
    return {(a or b).decode() for a, b in _IMPORT.findall(source)}


def module_file(name: str) -> Path | None:
    """Where this process loads ``name`` from (the imported module's, else the one the
    import system would find: an overlay on ``PYTHONPATH`` wins as it does for vLLM)."""
    module = sys.modules.get(name)
    origin = getattr(module, "__file__", None)
    if origin is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        origin = spec.origin if spec is not None else None
    if origin is None or not origin.endswith(".py"):
        return None
    return Path(origin)


def roots() -> set[str]:
    """Step 1 of the derivation (module docstring)."""
    found: set[str] = set()
    for target in OWNER_CLASSES.values():
        try:
            cls = _import_target(target)
        except (ImportError, AttributeError):
            continue  # a vLLM without that owner: the hook table check reports it
        for base in inspect.getmro(cls) if isinstance(cls, type) else ():
            if base.__module__.startswith("vllm."):
                found.add(base.__module__)
    found |= _counting_path_imports(_COUNTING_DIRS)
    return {m for m in found if module_file(m) is not None}


def covered_modules() -> list[str]:
    """Step 1 and 2: every vLLM module whose code is fingerprinted, sorted."""
    start = roots()
    packages = {m.rsplit(".", 1)[0] for m in start if m.count(".") >= _CLOSE_OVER_DEPTH}
    seen: set[str] = set()
    todo = sorted(start)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_file(name)
        if path is None:
            continue
        for imported in imports(_read(path)[1]):
            inside = any(imported == p or imported.startswith(p + ".") for p in packages)
            if inside and imported not in seen and module_file(imported) is not None:
                todo.append(imported)
    return sorted(seen)


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    first = body[0] if body else None
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return body[1:]
    return body


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _digest(node: ast.AST) -> str:
    text = ast.dump(node, annotate_fields=False, include_attributes=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _with_body(node: ast.AST, body: list[ast.stmt]) -> ast.AST:
    """A copy of a definition node with another body (the original is left as it is)."""
    fields = {f: getattr(node, f) for f in node._fields}
    fields["body"] = body or [ast.Pass()]
    return type(node)(**fields)


def _entries(body: list[ast.stmt], prefix: str, out: dict[str, str]) -> list[ast.stmt]:
    """Hash every definition in ``body`` into ``out``; return the other statements, with
    each definition replaced by its name (so a moved or renamed one still counts)."""
    rest: list[ast.stmt] = []
    for node in _without_docstring(body):
        if not isinstance(node, _DEFS):
            rest.append(node)
            continue
        qualname = prefix + node.name
        if isinstance(node, ast.ClassDef):
            own = _entries(node.body, qualname + ".", out)
            out[qualname] = _digest(_with_body(node, own))
        else:
            # Functions nested in a function are part of it: hash the whole function.
            out[qualname] = _digest(_with_body(node, _without_docstring(node.body)))
        rest.append(ast.Expr(ast.Name(node.name)))
    return rest


def module_hashes(source: str | bytes) -> dict[str, str]:
    """``{qualified name: hash}`` for one module's source (module docstring)."""
    out: dict[str, str] = {}
    rest = _entries(ast.parse(source).body, "", out)
    out[MODULE_ENTRY] = _digest(ast.Module(rest, []))
    return out


def _read(path: Path) -> tuple[tuple[str, int, int], bytes]:
    stat = os.stat(path)
    return (str(path), stat.st_size, stat.st_mtime_ns), path.read_bytes()


def file_digest(name: str) -> str:
    """sha256 (16 hex digits) of the bytes of the file this process loads ``name`` from;
    ``missing`` if it has no Python source. Equal bytes mean equal entries, so a
    comparison parses only the modules whose bytes changed."""
    path = module_file(name)
    if path is None:
        return "missing"
    return hashlib.sha256(_read(path)[1]).hexdigest()[:16]


def hashes_of(name: str) -> dict[str, str]:
    """:func:`module_hashes` of the file this process loads ``name`` from, cached by the
    file's (path, size, mtime); empty if it has no Python source."""
    path = module_file(name)
    if path is None:
        return {}
    key, source = _read(path)
    if key not in _cache:
        _cache[key] = module_hashes(source)
    return _cache[key]


def entries(modules: Iterable[str]) -> dict[str, str]:
    """``{module:qualname: hash}`` for these modules of the running vLLM."""
    return {f"{m}:{q}": h for m in modules for q, h in hashes_of(m).items()}
