"""vLLM's scheduler with patches of docs/vllm-patches/ applied, loaded beside the real one.

The installed ``vllm/v1/core/sched/scheduler.py`` and ``async_scheduler.py`` are
copied to a scratch folder, the patches are applied there with ``git apply`` (as a
vLLM developer would apply them to a checkout; their hunks for vLLM's tests are left
out, the tests are not installed), and the two files are imported under private
module names, the async one on top of the patched synchronous one. The canaries
then run on these classes instead of vLLM's own.
"""

from __future__ import annotations

import importlib.util
import itertools
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import vllm

from kvmetrics.integrations.vllm_lab.canaries import Target, vllm_version
from kvmetrics.integrations.vllm_lab.series import series

__all__ = ["installed_series", "patched_target"]
SCHED = Path("vllm/v1/core/sched")
_names = itertools.count()


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def installed_series() -> list[Path]:
    """The series for the installed vLLM (0.34's, or the 0.33.0 backport)."""
    return series(vllm_version())


def patched_target(patches: list[Path], scratch: Path) -> Target:
    """Schedulers from vLLM's files with ``patches`` applied (each must apply cleanly)."""
    installed = Path(vllm.__file__).resolve().parent.parent
    (scratch / SCHED).mkdir(parents=True)
    for name in ("scheduler.py", "async_scheduler.py"):
        shutil.copy(installed / SCHED / name, scratch / SCHED / name)
    for patch in patches:
        subprocess.run(["git", "apply", "--whitespace=nowarn", f"--include={SCHED}/*",
                        str(patch)], cwd=scratch, check=True, capture_output=True)
    n = next(_names)
    sync = _load(f"kvmetrics_patched_scheduler_{n}", scratch / SCHED / "scheduler.py")
    source = (scratch / SCHED / "async_scheduler.py").read_text()
    source = source.replace("from vllm.v1.core.sched.scheduler import Scheduler",
                            f"from {sync.__name__} import Scheduler")
    assert sync.__name__ in source, "async_scheduler.py no longer imports Scheduler by path"
    (scratch / SCHED / "async_scheduler.py").write_text(source)
    asynchronous = _load(f"kvmetrics_patched_async_scheduler_{n}",
                         scratch / SCHED / "async_scheduler.py")
    return Target(sync.Scheduler, asynchronous.AsyncScheduler)
