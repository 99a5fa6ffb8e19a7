"""No dead code in kvmetrics/: vulture finds nothing that nobody uses.

What the tests, benchmarks, scripts, dashboards and deploy files use counts as
used (they are the package's callers); what is used only in ways vulture cannot
see (vLLM or pytest calling by name, a string lookup) is in
``tests/vulture_allowlist.py``, each entry with its reason.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWLIST = ROOT / "tests" / "vulture_allowlist.py"
#: vulture's default: unused functions, classes, methods, attributes and variables
#: (60 %), imports (90 %), unreachable code and arguments (100 %).
MIN_CONFIDENCE = 60
CALLERS = ("tests", "benchmarks", "scripts", "dashboards", "deploy")


def _vulture(*paths: Path) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "vulture", *map(str, paths),
         "--min-confidence", str(MIN_CONFIDENCE)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "No module named vulture" not in done.stderr, \
        "vulture is missing: pip install -c scripts/constraints.txt '.[test]'"
    assert done.returncode in (0, 3), done.stderr  # 3: it found unused code
    return done.stdout.splitlines()


def test_vulture_finds_no_unused_code_in_kvmetrics() -> None:
    # Relative to ROOT (vulture's working directory), so its report names kvmetrics/...
    paths = [Path("kvmetrics"), *(Path(c) for c in CALLERS if (ROOT / c).is_dir()),
             ALLOWLIST.relative_to(ROOT)]
    found = [line for line in _vulture(*paths) if line.startswith("kvmetrics/")]
    assert found == []


def test_vulture_reports_a_function_nobody_calls(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text("def used():\n    return 1\n\n\ndef forgotten():\n    return 2\n\n\n"
                      "print(used())\n")
    assert [re.sub(r"^.*?:", "", line) for line in _vulture(module)] == [
        "5: unused function 'forgotten' (60% confidence)"]


def test_every_allowlisted_name_still_exists_and_says_why() -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "kvmetrics").rglob("*.py"))
    lines = [line for line in ALLOWLIST.read_text().splitlines() if line.startswith("_.")]
    assert 0 < len(lines) <= 30
    for line in lines:
        name = line.split()[0].removeprefix("_.")
        assert re.search(rf"\b{re.escape(name)}\b", source), f"{name} is gone from kvmetrics/"
        assert "  # " in line and len(line.split("  # ", 1)[1]) > 10, f"{name}: say why"
    ast.parse(ALLOWLIST.read_text())
