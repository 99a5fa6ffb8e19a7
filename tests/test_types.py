"""kvmetrics/ type-checks clean: mypy, configured in pyproject.toml ([tool.mypy]).

Strict by default, so the code `vllm serve` loads (kvmetrics.metrics, .exporters, .vllm,
.faults, .protect) and every new module is held to it; the lab (with its reference engine,
data plane and vLLM harness) and the commands are listed for a lighter setting. Each remaining
``type: ignore`` names its error code and says why.

mypy's cache lives in the system's temporary directory, never in the repository: a
fresh clone checks everything (about 80 s of CPU, most of it reading vLLM's and
torch's own annotations); a re-run with the cache reads only what changed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(tempfile.gettempdir()) / f"kvmetrics-mypy-cache-{os.getuid()}"
#: The packages `vllm serve` imports (the observer, its exporters, the fault connector, the
#: protective recovery).
SHIPPED = ("kvmetrics.metrics", "kvmetrics.exporters", "kvmetrics.vllm", "kvmetrics.faults",
           "kvmetrics.protect")


def _mypy(*args: str, cwd: Path = ROOT, cache: Path = CACHE) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(cache), "--no-error-summary", "--no-pretty", *args],
        capture_output=True, text=True, timeout=900, cwd=cwd)
    assert "No module named mypy" not in done.stderr, \
        "mypy is missing: pip install -c scripts/constraints.txt '.[test]'"
    assert done.returncode in (0, 1), done.stderr[-2000:]  # 1: it found errors
    return [line for line in done.stdout.splitlines() if ": error:" in line]


def test_mypy_finds_no_type_error_in_kvmetrics() -> None:
    assert _mypy() == []


def _lighter_modules() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["strict"] is True
    lighter = []
    for override in config.get("overrides", []):
        if override.get("disallow_untyped_defs") is False:
            modules = override["module"]
            lighter += [modules] if isinstance(modules, str) else modules
    return lighter


def test_no_module_vllm_serve_loads_is_let_off_strict() -> None:
    lighter = _lighter_modules()
    assert "kvmetrics.lab.*" in lighter
    for pattern in lighter:
        prefix = pattern.removesuffix(".*")
        assert not any(prefix == s or prefix.startswith(s + ".") or s.startswith(prefix + ".")
                       for s in SHIPPED), pattern


def test_strict_reports_an_unannotated_function_where_vllm_serve_runs(tmp_path: Path) -> None:
    """The configuration itself: the same unannotated function is an error in a shipped
    package and allowed in the lab."""
    for package in ("kvmetrics", "kvmetrics/exporters", "kvmetrics/lab"):
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    code = "def double(x):\n    return x * 2\n"
    (tmp_path / "kvmetrics/exporters/probe.py").write_text(code)
    (tmp_path / "kvmetrics/lab/probe.py").write_text(code)
    errors = _mypy("kvmetrics/exporters/probe.py", "kvmetrics/lab/probe.py",
                   cwd=tmp_path, cache=tmp_path / "cache")
    assert [re.sub(r":\d+: error:.*\[", " [", e) for e in errors] == [
        "kvmetrics/exporters/probe.py [no-untyped-def]"]


_IGNORE = re.compile(r"#\s*type:\s*ignore(?P<codes>\[[a-z-]+(?:,\s*[a-z-]+)*\])?(?P<rest>.*)$")


def test_every_type_ignore_names_its_code_and_says_why() -> None:
    problems = []
    for path in sorted((ROOT / "kvmetrics").rglob("*.py")):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, start=1):
            found = _IGNORE.search(line)
            if found is None:
                continue
            where = f"{path.relative_to(ROOT)}:{number}"
            reason_here = re.match(r"\s*#\s*\S{3,}", found["rest"])
            above = lines[number - 2].strip() if number > 1 else ""
            if not found["codes"]:
                problems.append(f"{where}: no error code")
            elif not reason_here and not above.startswith("#"):
                problems.append(f"{where}: no reason (a comment after it or on the line above)")
    assert problems == []
