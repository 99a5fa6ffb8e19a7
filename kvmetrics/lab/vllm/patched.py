"""vLLM's scheduler with patches of docs/vllm-patches/ applied, loaded beside the real one.

The installed ``vllm/v1/core/sched/scheduler.py`` and ``async_scheduler.py`` (and
the KV cache manager and coordinator, which a patch may change too) are copied to a
scratch folder, the patches are applied there with ``git apply`` (as a vLLM developer
would apply them to a checkout; their hunks for vLLM's tests are left out, the tests
are not installed), and the files are imported under private module names, each on
top of the patched ones it imports. The canaries then run on these classes instead of
vLLM's own. A manager or coordinator that no patch changes stays vLLM's own module.
"""

from __future__ import annotations

import importlib.util
import itertools
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import vllm

from kvmetrics.lab.vllm.canaries import Target, vllm_version
from kvmetrics.lab.vllm.series import series

__all__ = ["installed_series", "patched_target"]
CORE = Path("vllm/v1/core")
_names = itertools.count()


@dataclass(frozen=True)
class _Module:
    #: vLLM's dotted module name.
    name: str
    #: Whether it is loaded patched even when no patch changes it (the schedulers).
    always: bool = False

    @property
    def path(self) -> Path:
        return Path(*self.name.split(".")).with_suffix(".py")


#: The modules a patch may change, in import order: each imports only earlier ones
#: among them.
MODULES = (
    _Module("vllm.v1.core.kv_cache_coordinator"),
    _Module("vllm.v1.core.kv_cache_manager"),
    _Module("vllm.v1.core.sched.scheduler", always=True),
    _Module("vllm.v1.core.sched.async_scheduler", always=True),
)


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
    for module in MODULES:
        (scratch / module.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(installed / module.path, scratch / module.path)
    for patch in patches:
        subprocess.run(["git", "apply", "--whitespace=nowarn", f"--include={CORE}/*",
                        str(patch)], cwd=scratch, check=True, capture_output=True)
    n = next(_names)
    loaded: dict[str, str] = {}  # vLLM's module name -> the patched copy's name
    for module in MODULES:
        source = (scratch / module.path).read_text()
        changed = source != (installed / module.path).read_text()
        imports = [name for name in loaded if f"from {name} import " in source]
        if not (changed or imports or module.always):
            continue
        for name in imports:
            source = source.replace(f"from {name} import ", f"from {loaded[name]} import ")
        (scratch / module.path).write_text(source)
        private = f"kvmetrics_patched_{module.path.stem}_{n}"
        _load(private, scratch / module.path)
        loaded[module.name] = private
    sync = sys.modules[loaded["vllm.v1.core.sched.scheduler"]]
    asynchronous = sys.modules[loaded["vllm.v1.core.sched.async_scheduler"]]
    assert sync.__name__ in (scratch / MODULES[-1].path).read_text(), \
        "async_scheduler.py no longer imports Scheduler by path"
    return Target(sync.Scheduler, asynchronous.AsyncScheduler)
