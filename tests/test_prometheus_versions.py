"""The exporter works at both ends of the prometheus-client range pyproject.toml allows.

kvmetrics/exporters/prometheus_internals.py and mmap_space.py use private names of
prometheus-client (their docstrings say which); CI installs one version
(scripts/constraints.txt).
Here the tests that exercise those names, and the multiprocess merge that mirrors the
library's, run again with the lowest allowed version installed into a directory put
ahead of the environment's own on PYTHONPATH (needs a package index, as
tests/test_install.py does). The highest, 0.26.0 (the newest release), is the version
CI pins and the whole suite runs on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.index

ROOT = Path(__file__).resolve().parents[1]
#: The test modules that reach those two: the per-metric ``_created`` filter, the
#: reserved value files, the value-class switch, the merge checked against the library's.
MODULES = ("tests/test_exporters_prometheus.py", "tests/test_multiprocess_hostile.py")


def _allowed_range() -> tuple[str, str]:
    """(lowest allowed, the version CI pins): pyproject's floor and constraints.txt."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    req = next(Requirement(d) for d in deps if Requirement(d).name == "prometheus-client")
    floor = next(s.version for s in req.specifier if s.operator == ">=")
    pinned = re.search(r"^prometheus_client==(\S+)$",
                       (ROOT / "scripts" / "constraints.txt").read_text(), re.M)
    assert pinned is not None
    return floor, pinned.group(1)


def test_the_suite_runs_on_the_highest_allowed_version() -> None:
    import importlib.metadata

    floor, pinned = _allowed_range()
    assert (floor, pinned) == ("0.20", "0.26.0")
    assert importlib.metadata.version("prometheus-client") == pinned


@pytest.mark.parametrize("version", ["0.20.0"])
def test_the_exporter_tests_pass_with_the_lowest_prometheus_client(version: str,
                                                                   tmp_path: Path) -> None:
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "--quiet",
         "--no-deps", "--no-compile", "--target", str(target),
         f"prometheus-client=={version}"],
        capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, \
        f"cannot install prometheus-client {version} (a package index is needed): " \
        f"{install.stderr[-1000:]}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(target), str(ROOT), os.environ.get("PYTHONPATH")]))}
    which = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m, prometheus_client as p; "
                               "print(m.version('prometheus-client'), p.__file__)"],
        env=env, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert which[0] == version and which[1].startswith(str(target)), which
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MODULES],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
