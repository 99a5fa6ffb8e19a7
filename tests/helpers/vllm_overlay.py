"""A vLLM whose one module file is changed, without copying vLLM.

The overlay is a directory for ``PYTHONPATH`` whose ``vllm`` package is a tree of real
directories along the changed module's path and symbolic links to the installed files
everywhere else, so it costs milliseconds, and Python imports the changed file exactly as
it would from a patched install or a fork. The two edits are the pair the fingerprints
must tell apart: one character of code (flagged) and pure formatting (not flagged).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path


def function_lines(source: str, qualname: str) -> tuple[int, int]:
    """First and last line (1-based) of ``Class.method`` or ``function`` in ``source``."""
    body: list[ast.stmt] = ast.parse(source).body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next(n for n in body if getattr(n, "name", None) == part)
        body = getattr(node, "body", [])
    assert node is not None and node.end_lineno is not None
    return node.lineno, node.end_lineno


def one_character_changed(source: str, qualname: str) -> str:
    """``source`` with the first ``return x`` of that function made ``return -x``."""
    lines = source.splitlines(keepends=True)
    first, last = function_lines(source, qualname)
    for i in range(first - 1, last):
        if lines[i].lstrip().startswith("return "):
            lines[i] = lines[i].replace("return ", "return -", 1)
            return "".join(lines)
    raise ValueError(f"{qualname} has no return statement to change")


def reformatted(source: str, qualname: str) -> str:
    """``source`` with a comment and blank lines added inside that function: the code is
    the same."""
    lines = source.splitlines(keepends=True)
    first, _ = function_lines(source, qualname)
    lines.insert(first, "\n        # reformatted: a comment and blank lines\n\n")
    return "".join(lines)


def overlay(dest: Path, package_dir: Path, relative: str, new_source: str) -> Path:
    """Lay out ``dest/vllm`` as the installed ``package_dir`` with ``relative`` (a file
    path inside the package) replaced by ``new_source``; return ``dest``."""
    parts = Path(relative).parts
    real, here = package_dir, dest / "vllm"
    for depth in range(len(parts)):
        here.mkdir(parents=True, exist_ok=True)
        for entry in real.iterdir():
            if entry.name != parts[depth] and entry.name != "__pycache__":
                os.symlink(entry, here / entry.name)
        real, here = real / parts[depth], here / parts[depth]
    here.write_text(new_source, encoding="utf-8")
    return dest


def parameter_renamed(source: str, qualname: str, old: str, new: str) -> str:
    """``source`` with parameter ``old`` of that function called ``new`` in its ``def``
    (the body is left alone: a signature change the hook table must notice)."""
    lines = source.splitlines(keepends=True)
    first, _ = function_lines(source, qualname)
    for i in range(first - 1, first + 5):
        if f", {old}" in lines[i]:
            lines[i] = lines[i].replace(f", {old}", f", {new}", 1)
            return "".join(lines)
    raise ValueError(f"{qualname} has no parameter {old} on its first lines")


def overlay_files(dest: Path, package_dir: Path, new_sources: dict[str, str]) -> Path:
    """Lay out ``dest/vllm`` as the installed ``package_dir`` with every file of
    ``new_sources`` (paths inside the package -> source) replaced; return ``dest``.
    Directories on a replaced file's path are real, everything else links to the
    installed files."""
    real_dirs = {Path(*Path(rel).parts[:depth]) for rel in new_sources
                 for depth in range(len(Path(rel).parts))}
    replaced = {Path(rel): source for rel, source in new_sources.items()}

    def lay_out(relative: Path) -> None:
        (dest / "vllm" / relative).mkdir(parents=True, exist_ok=True)
        for entry in (package_dir / relative).iterdir():
            inner = relative / entry.name
            if entry.name == "__pycache__":
                continue
            if inner in replaced:
                (dest / "vllm" / inner).write_text(replaced.pop(inner), encoding="utf-8")
            elif inner in real_dirs:
                lay_out(inner)
            else:
                os.symlink(entry, dest / "vllm" / inner)

    lay_out(Path())
    if replaced:
        raise FileNotFoundError(f"not in {package_dir}: {sorted(map(str, replaced))}")
    return dest
