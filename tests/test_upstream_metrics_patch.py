"""docs/vllm-patches/0005 (KV-load failure metrics in vLLM itself) counts what kvmetrics
counts.

The patch is applied to copies of the three vLLM files it changes, taken from the light
vLLM 0.34.0 install, and laid over that install (tests/helpers/vllm_overlay.py). A fresh
interpreter runs kvmetrics' in-process fault workloads (random requests sharing
prefixes, 15% of loaded blocks failing; sync, async and mixed loads; both policies;
with and without async scheduling) on
the patched scheduler with kvmetrics' instrumentation, feeds every step's
``SchedulerStats`` to vLLM's own Prometheus stat logger, and reports vLLM's counters
next to kvmetrics' counts of the same run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvmetrics.lab.vllm.series import PATCHES
from tests.helpers.vllm_overlay import overlay_files

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
LIGHT = ROOT / ".vllm-versions" / "0.34.0-light"
PATCH = PATCHES / "0005-kv-load-failure-metrics.patch"
CHANGED = ("v1/core/sched/scheduler.py", "v1/metrics/loggers.py", "v1/metrics/stats.py")


def patched_vllm(work: Path) -> Path:
    """A PYTHONPATH entry whose ``vllm`` is the light 0.34.0 with 0005 applied."""
    if not (LIGHT / "vllm" / "__init__.py").is_file():
        pytest.fail(f"no light vLLM 0.34.0 in {LIGHT}: run `bash scripts/install.sh --test "
                    "--vllm`")
    scratch = work / "sources"
    for name in CHANGED:
        (scratch / "vllm" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(LIGHT / "vllm" / name, scratch / "vllm" / name)
    subprocess.run(["git", "apply", "--include=vllm/*", str(PATCH)], cwd=scratch,
                   check=True, capture_output=True)
    return overlay_files(work / "overlay", LIGHT / "vllm", {
        name: (scratch / "vllm" / name).read_text(encoding="utf-8") for name in CHANGED})


def test_vllm_counters_equal_kvmetrics_counts(tmp_path: Path) -> None:
    overlay = patched_vllm(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(overlay), str(LIGHT), str(ROOT)]),
           "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.helpers.native_metrics_worker"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)
    mutated = results.pop("mutated-sync-recompute")
    unreadable = results.pop("unreadable-sync-recompute")
    assert len(results) == 9
    # kvmetrics takes vLLM's figures as its check at run time: equal on every recorded
    # step, and a figure off by one is counted.
    assert all(run["compared"] and run["check_failures"] == 0 for run in results.values())
    assert mutated["compared"] and mutated["check_failures"] > 0
    # Figures it cannot read: one failure counted, and no comparison from then on.
    assert not unreadable["compared"] and unreadable["check_failures"] == 1
    for name, run in results.items():
        # vLLM shipped stats for every step it scheduled, and the workload did hit
        # failures.
        assert run["steps_with_stats"] == run["steps_scheduled"] > 0, name
        assert run["vllm"] == run["kvmetrics"], name
        assert run["vllm"]["vllm:kv_load_failed_blocks_total"] > 0, name
        assert run["vllm"]["vllm:kv_load_failed_requests_total"] > 0, name
        assert run["vllm"]["vllm:kv_load_rolled_back_tokens_total"] > 0, name
        recomputed = run["vllm"]["vllm:kv_load_recomputed_tokens_total"]
        assert (recomputed > 0) == name.endswith("recompute"), name


def test_blocks_of_a_load_failed_whole_are_left_out_of_the_comparison() -> None:
    """vLLM counts no block for a load a connector failed whole (``failed_recving``);
    kvmetrics counts all of them as failed, so the comparison leaves them out, and
    still counts a difference in the blocks vLLM does count."""
    from types import SimpleNamespace

    from kvmetrics.metrics import catalogue as cat
    from kvmetrics.metrics.events import StepEvents
    from kvmetrics.vllm import native_stats
    from kvmetrics.vllm.selfcheck import SelfChecks

    def failures(theirs: list[int]) -> float:
        kv = SimpleNamespace(native_sum=theirs, native_unread=False, disabled=frozenset(),
                             self_checks=SelfChecks())
        events = StepEvents(step=1)
        events.loaded_blocks("async", 0, 4, whole_load=True)  # a load failed whole
        events.loaded_blocks("sync", 5, 2)  # two blocks in invalid_block_ids
        events.failed_load_request("sync", "recompute", "rescheduled", "r1")
        native_stats.compare(kv, events)  # type: ignore[arg-type]
        return sum(i.amount for i in events.increments if i.spec is cat.SELF_CHECK_FAILURES)

    assert failures([2, 1, 0, 0]) == 0
    assert failures([6, 1, 0, 0]) == 1
    assert failures([2, 2, 0, 0]) == 1
