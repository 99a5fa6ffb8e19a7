"""``scripts/check-vllm-release.sh`` on a build that is not a release: a source tree.

The tree is the installed vLLM package with its block pool changed the way a patched
vLLM or vLLM main would change it: one character of one function's code, and a renamed
parameter of a hooked method. The script must name both (the fingerprint diff and the
hook table), and answer a bad argument with one line and exit status 2. ``--quick``
stops before the in-process suite, so this costs one vLLM import.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import vllm_overlay

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check-vllm-release.sh"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, check=False, env=env)


@pytest.mark.parametrize("args", [(), ("0.35",), ("nowhere/vllm.zip",), (str(ROOT),),
                                  ("--quick", "0.35.0", "extra")])
def test_a_bad_argument_gets_one_line_and_status_2(args: tuple[str, ...]) -> None:
    done = run(*args)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""


def test_a_source_tree_with_a_changed_function_is_named(tmp_path: Path) -> None:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    package = Path(spec.origin).parent
    original = (package / "v1" / "core" / "block_pool.py").read_text(encoding="utf-8")
    changed = vllm_overlay.one_character_changed(original, "BlockPool.get_num_free_blocks")
    changed = vllm_overlay.parameter_renamed(changed, "BlockPool._maybe_evict_cached_block",
                                             "block", "blok")
    tree = vllm_overlay.overlay(tmp_path / "vllm-main", package, "v1/core/block_pool.py",
                                changed)
    env = {**os.environ, "KVMETRICS_RELEASE_PYTHON": sys.executable}
    done = run("--quick", str(tree), env=env)
    out = done.stdout
    assert done.returncode == 1, (out, done.stderr[-3000:])
    differs = [line.strip() for line in out.splitlines() if "differs:" in line]
    assert differs == [
        "differs: vllm.v1.core.block_pool:BlockPool._maybe_evict_cached_block",
        "differs: vllm.v1.core.block_pool:BlockPool.get_num_free_blocks"], out
    assert "broken: block_pool._maybe_evict_cached_block: expected parameters ('block',)" in out
    assert "fingerprints: DIFFER" in out and "hook table: BROKEN" in out
