"""Mutants of the vLLM modules kvmetrics hooks or fingerprints, generated from their source.

The modules and the functions on the counted path are derived from the hook table, not
listed: the module of each class a hook or a read attribute belongs to
(:data:`source_hashes.OWNER_CLASSES`), there each hooked method, the ``__init__`` that
sets up the state the hooks read, each read attribute that is a method or property, a
read dataclass as a whole, every method named like a hook of :data:`hooks.HOOKS`, and,
transitively, the functions of the same module those call. Each operator is applied at
every site it finds in them; a mutant changes only the source of the functions (or
class-level statements) it touches, so every other function keeps its exact text.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

OPERATORS = ("rename_attribute", "rename_method", "add_parameter", "bypass_hook",
             "drop_call", "skip_increment", "off_by_one", "add_queue")
PARKED = "kvm_parked"


@dataclass(frozen=True)
class Mutant:
    #: The module the site is in.
    module: str
    operator: str
    site: str
    #: The new source of each module the mutant changes (a rename reaches every
    #: targeted module that uses the name, as a rename in vLLM would).
    sources: dict[str, str]


@dataclass
class _Module:
    name: str
    text: str
    tree: ast.Module
    functions: dict[str, ast.FunctionDef]  # qualname -> def
    counted: set[str]
    #: ``ast.dump`` of each unit (:func:`_units`), computed once.
    dumps: list[str] = field(default_factory=list)

    def fresh_tree(self) -> ast.Module:
        """A tree to edit (parsing again is cheaper than a deep copy)."""
        return ast.parse(self.text)

    def unit_dumps(self) -> list[str]:
        if not self.dumps:
            self.dumps = [ast.dump(u) for u in _units(self.tree)]
        return self.dumps


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    out: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out[f"{node.name}.{item.name}"] = item
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = node
    return out


def _called_names(fn: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def counted_roots() -> dict[str, set[str]]:
    """``{module: qualnames}`` where the counted path starts (module docstring)."""
    # Imported here, not at the top: the campaign's parent must not import the vLLM
    # modules it mutates (its children fork from it and lay the mutants over them).
    from kvmetrics.vllm import hooks, source_hashes

    roots: dict[str, set[str]] = {}

    def add(owner: str, *leaves: str) -> None:
        target = source_hashes.OWNER_CLASSES.get(owner)
        if target is None:
            return
        module, _, cls = target.partition(":")
        roots.setdefault(module, set()).update(f"{cls}.{leaf}" if leaf else cls
                                               for leaf in leaves)

    for hook in hooks.HOOKS:
        add(hook.owner, hook.method, "__init__")
    for attribute in hooks.ATTRIBUTES:
        if attribute.owner == "kv_connector_output":
            add(attribute.owner, "")  # a dataclass read field by field: all of it
        else:
            add(attribute.owner, "__init__", *attribute.names)
    return roots


def counted_modules(overlayable_only: bool = False) -> list[_Module]:
    """Each targeted vLLM module, parsed, with the qualnames on its counted path.

    ``overlayable_only`` (the campaign's parent, a fresh process): leave out a module that
    the campaign's warm imports or its own package already load (vLLM's config pulls in
    the output dataclasses, the connector package its base), since a forked child cannot
    run a mutant of it; the fingerprints cover those."""
    import sys

    from kvmetrics.lab.vllm.mutations import worker
    from kvmetrics.vllm import hooks

    if overlayable_only:
        for name in worker.WARM_IMPORTS:
            importlib.import_module(name)
    preloaded = sys.modules if overlayable_only else {}
    roots = counted_roots()
    hooked = {hook.method for hook in hooks.HOOKS}
    out = []
    for module, names in sorted(roots.items()):
        if module in preloaded:
            continue
        spec = importlib.util.find_spec(module)  # imports the parent packages
        if spec is None or spec.origin is None or module in preloaded:
            continue
        with open(spec.origin, encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text)
        functions = _functions(tree)
        counted = {q for q in functions if q in names or q.split(".")[0] in names
                   or q.rsplit(".", 1)[-1] in hooked}
        by_leaf: dict[str, list[str]] = {}
        for q in functions:
            by_leaf.setdefault(q.rsplit(".", 1)[-1], []).append(q)
        todo = list(counted)
        while todo:
            for leaf in _called_names(functions[todo.pop()]):
                for q in by_leaf.get(leaf, ()):
                    if q not in counted:
                        counted.add(q)
                        todo.append(q)
        out.append(_Module(module, text, tree, functions, counted))
    return out


def _units(tree: ast.Module) -> Iterator[ast.stmt]:
    """Top-level and class-level statements (a class's own statements, not the class)."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            yield from node.body
        else:
            yield node


def splice(mod: _Module, after: ast.Module) -> str:
    """The module's text with only the units that differ in ``after`` rewritten."""
    lines = mod.text.splitlines(keepends=True)
    changed = []
    for old, dump, new in zip(_units(mod.tree), mod.unit_dumps(), _units(after), strict=True):
        if dump != ast.dump(new):
            start = min([old.lineno] + [d.lineno for d in getattr(old, "decorator_list", [])])
            indent = " " * old.col_offset
            body = "".join(indent + line + "\n" for line in ast.unparse(new).splitlines())
            changed.append((start - 1, old.end_lineno, body))
    for start, end, body in sorted(changed, reverse=True):
        lines[start:end] = [body]
    return "".join(lines)


def _self_attr(node: ast.AST) -> str | None:
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self"):
        return node.attr
    return None


def _rename_everywhere(tree: ast.Module, old: str, new: str) -> int:
    """Rename ``old`` (attribute, method, class-level field) in the tree; how many sites."""
    renamed = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == old:
            node.attr = new
        elif isinstance(node, ast.FunctionDef) and node.name == old:
            node.name = new
        elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
              and node.target.id == old):
            node.target.id = new
        else:
            continue
        renamed += 1
    return renamed


def _counted_nodes(mod: _Module, tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef]]:
    functions = _functions(tree)
    for qualname in sorted(mod.counted):
        yield qualname, functions[qualname]


#: Edits a fresh copy of the module's tree in place (lambdas with their site bound as
#: defaults, hence the open parameter list).
Edit = Callable[..., object]


def sites(mod: _Module) -> Iterator[tuple[str, str, Edit]]:
    """(operator, site, edit of a fresh copy of the tree) for every site."""
    from kvmetrics.vllm import hooks

    hooked = {hook.method for hook in hooks.HOOKS}
    attributes = sorted({a for _, fn in _counted_nodes(mod, mod.tree) for n in ast.walk(fn)
                         if isinstance(getattr(n, "ctx", None), ast.Store)
                         and (a := _self_attr(n))})
    for attr in attributes:
        yield "rename_attribute", attr, lambda t, a=attr: _rename_everywhere(t, a, a + "_v2")
    for qualname, fn in _counted_nodes(mod, mod.tree):
        leaf = fn.name
        if not leaf.startswith("__"):
            yield "rename_method", qualname, lambda t, m=leaf: _rename_everywhere(t, m, m + "_v2")
            yield "add_parameter", qualname, lambda t, q=qualname: _add_parameter(t, q)
    for op, kinds in (("drop_call", ast.Expr), ("skip_increment", ast.AugAssign),
                      ("off_by_one", ast.AugAssign), ("bypass_hook", ast.Call),
                      ("add_queue", ast.Call)):
        for qualname, fn in _counted_nodes(mod, mod.tree):
            found: list[Any] = [n for n in ast.walk(fn) if isinstance(n, kinds)]
            for index, node in enumerate(found):
                if op == "drop_call" and not isinstance(node.value, ast.Call):
                    continue
                if op == "bypass_hook" and not (isinstance(node.func, ast.Attribute)
                                                and node.func.attr in hooked):
                    continue
                if op == "add_queue" and not _parks(node):
                    continue
                callee = ""
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    callee = f"->{node.func.attr}"
                site = f"{qualname}{callee}@{node.lineno}"
                yield op, site, lambda t, q=qualname, i=index, o=op, k=kinds: _edit_node(
                    t, q, i, o, k)


def _parks(node: ast.Call) -> bool:
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr in ("add_request", "prepend_request")
            and _self_attr(f.value) == "waiting")


def _add_parameter(tree: ast.Module, qualname: str) -> None:
    fn = _functions(tree)[qualname]
    position = 1 if fn.args.args and fn.args.args[0].arg == "self" else 0
    fn.args.args.insert(position, ast.arg("kvm_extra"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == fn.name):
            node.args.insert(0, ast.Constant(None))


class _Replace(ast.NodeTransformer):
    def __init__(self, target: ast.AST, replacement: ast.AST) -> None:
        self.target, self.replacement = target, replacement

    def generic_visit(self, node: ast.AST) -> ast.AST:
        return self.replacement if node is self.target else super().generic_visit(node)


def _edit_node(tree: ast.Module, qualname: str, index: int, op: str, kinds: type) -> None:
    fn = _functions(tree)[qualname]
    node: Any = [n for n in ast.walk(fn) if isinstance(n, kinds)][index]
    new: ast.AST
    if op in ("drop_call", "skip_increment"):
        new = ast.Pass()
    elif op == "off_by_one":
        new = ast.AugAssign(node.target, node.op, ast.BinOp(node.value, ast.Add(),
                                                            ast.Constant(1)))
    elif op == "bypass_hook":
        owner = node.func.value
        cls = qualname.split(".")[0] if _self_attr(node.func) else None
        klass = ast.Name(cls) if cls and "." in qualname else ast.Call(
            ast.Name("type"), [copy.deepcopy(owner)], [])
        new = ast.Call(ast.Attribute(klass, node.func.attr), [owner, *node.args],
                       node.keywords)
    else:  # add_queue: the request is parked, and put back at the next schedule()
        new = ast.Call(ast.Attribute(ast.Attribute(ast.Name("self"), PARKED), "append"),
                       node.args, [])
        _add_parking(tree, qualname.split(".")[0])
    fn.body = [_Replace(node, new).visit(s) for s in fn.body]
    ast.fix_missing_locations(tree)


def _add_parking(tree: ast.Module, cls: str) -> None:
    functions = _functions(tree)
    functions[f"{cls}.__init__"].body.append(ast.parse(f"self.{PARKED} = []").body[0])
    release = ast.parse(f"for _parked in self.{PARKED}:\n    self.waiting.add_request(_parked)\n"
                        f"self.{PARKED}.clear()").body
    schedule = functions[f"{cls}.schedule"]
    schedule.body[1:1] = release if ast.get_docstring(schedule) else []
    if not ast.get_docstring(schedule):
        schedule.body[0:0] = release


def mutant_at(module: str, operator: str, site_prefix: str) -> Mutant:
    """The first mutant of ``module`` with this operator at a site starting with
    ``site_prefix`` (planted-bug tests pick a known site this way)."""
    for mod in counted_modules():
        if mod.name != module:
            continue
        for op, site, edit in sites(mod):
            if op == operator and site.startswith(site_prefix):
                tree = mod.fresh_tree()
                edit(tree)
                return Mutant(module, op, site, {module: splice(mod, tree)})
    raise LookupError(f"no {operator} site {site_prefix!r} in {module}")


def generate(budget: int, seed: int, modules: list[_Module] | None = None) -> list[Mutant]:
    """``budget`` mutants, drawn (seeded) round-robin over the modules so each gets a share."""
    per_module: list[list[tuple[_Module, str, str, Edit]]] = []
    modules_list = modules if modules is not None else counted_modules()
    for mod in modules_list:
        drawn = [(mod, op, site, edit) for op, site, edit in sites(mod)]
        random.Random(f"{seed}:{mod.name}").shuffle(drawn)
        per_module.append(drawn)
    out: list[Mutant] = []
    while len(out) < budget and any(per_module):
        for drawn in per_module:
            while drawn and len(out) < budget:
                mod, op, site, edit = drawn.pop()
                tree = mod.fresh_tree()
                try:
                    edit(tree)
                    source = splice(mod, tree)
                except (KeyError, ValueError, IndexError):
                    continue  # the operator does not apply to this module's shape
                if source == mod.text:
                    continue
                sources = {mod.name: source}
                if op.startswith("rename_"):
                    old = site.rsplit(".", 1)[-1]
                    for other in modules_list:
                        if other is not mod:
                            renamed = other.fresh_tree()
                            if _rename_everywhere(renamed, old, old + "_v2"):
                                sources[other.name] = splice(other, renamed)
                out.append(Mutant(mod.name, op, site, sources))
                break
    return out
