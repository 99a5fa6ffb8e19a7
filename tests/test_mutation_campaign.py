"""The mutation campaign: generated changes to vLLM's counted path are CORRECT or FLAGGED.

A fast, seeded subset of the campaign runs here (the full one is a documented command,
docs/vllm-research.md). It fails on any SILENT or CRASH mutant. The planted bugs show the
classifier can fail: without its guard kvmetrics crashes vLLM (CRASH), without its
cross-checks a mutant that kvmetrics flags goes SILENT.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from kvmetrics.lab.vllm.mutations import generator
from kvmetrics.lab.vllm.mutations.worker import PLANT_ENV

pytestmark = pytest.mark.vllm

FAST_BUDGET = 24
FAST_SEED = 0
#: A finish that skips kvmetrics' ``_free_request`` override: the finished counter misses
#: it, and only kvmetrics' cross-checks (the finish self-check, the fingerprints) say so.
MISSED_FINISH = ("vllm.v1.core.sched.scheduler:bypass_hook:"
                 "Scheduler.update_from_output->_free_request")
#: A hooked method with a new required parameter: kvmetrics' hook check refuses it.
CHANGED_HOOK = "vllm.v1.core.kv_cache_manager:add_parameter:KVCacheManager.evict_blocks"


def campaign(*args: str, plant: str | None = None) -> tuple[int, dict[str, str], str]:
    """Run the CLI in a fresh process: (exit status, {mutant id: class}, its output)."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1")
    env.pop(PLANT_ENV, None)
    if plant:
        env[PLANT_ENV] = plant
    done = subprocess.run(
        [sys.executable, "-m", "kvmetrics.lab.vllm.mutations", *args],
        capture_output=True, text=True, env=env, timeout=900, check=False)
    table = done.stdout.split("\nmutant  module", 1)[-1]
    verdicts = {line.split("  ")[0]: line.split("  ")[4]
                for line in table.splitlines() if line.startswith("m0")}
    return done.returncode, verdicts, done.stdout + done.stderr


def _functions(source: str) -> dict[str, tuple[str, list[str]]]:
    """Each function's AST dump and its lines as written, by name (the last of a name)."""
    lines = source.split("\n")
    return {node.name: (ast.dump(node), lines[node.lineno - 1:node.end_lineno])
            for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)
            and node.end_lineno is not None}


def test_a_mutant_rewrites_only_the_functions_it_changes() -> None:
    modules = generator.counted_modules()
    originals = {m.name: _functions(m.text) for m in modules}
    for mutant in generator.generate(60, FAST_SEED, modules):
        for module, source in mutant.sources.items():
            before = originals[module]
            lines = source.split("\n")
            for node in ast.walk(ast.parse(source)):
                if not isinstance(node, ast.FunctionDef):
                    continue
                twin = before.get(node.name)
                if twin is not None and twin[0] == ast.dump(node):
                    assert lines[node.lineno - 1:node.end_lineno] == twin[1], (
                        mutant.operator, mutant.site, node.name)


def test_every_hooked_module_and_operator_has_sites() -> None:
    mutants = generator.generate(120, FAST_SEED)
    modules = {m.module for m in mutants}
    for module in ("vllm.v1.core.sched.scheduler", "vllm.v1.core.kv_cache_manager",
                   "vllm.v1.core.block_pool"):
        assert module in modules
    operators = {op for mod in generator.counted_modules() for op, _, _ in generator.sites(mod)}
    assert operators == set(generator.OPERATORS), set(generator.OPERATORS) - operators


def test_the_fast_campaign_has_no_silent_or_crashing_mutant() -> None:
    """The seeded subset, and the planted bugs' two mutants as kvmetrics flags them."""
    status, verdicts, output = campaign("--budget", str(FAST_BUDGET), "--seed",
                                        str(FAST_SEED), "--jobs", "2",
                                        "--site", MISSED_FINISH, "--site", CHANGED_HOOK)
    assert verdicts.get("m000") == "CORRECT", output[-4000:]
    assert len(verdicts) == FAST_BUDGET + 3, output[-4000:]
    last = sorted(verdicts)[-2:]
    assert [verdicts[k] for k in last] == ["FLAGGED", "FLAGGED"], output[-4000:]
    bad = {k: v for k, v in verdicts.items() if v in ("SILENT", "CRASH")}
    assert status == 0 and not bad, output[-6000:]


@pytest.mark.parametrize(("site", "plant", "expected"), [
    (MISSED_FINISH, "no_crosscheck", "SILENT"),
    (CHANGED_HOOK, "unguard", "CRASH"),
])
def test_a_planted_bug_in_kvmetrics_is_caught(site: str, plant: str,
                                              expected: str) -> None:
    """The same mutants as in the fast campaign (FLAGGED there), on a kvmetrics with a
    bug planted in the child process only."""
    status, verdicts, output = campaign("--budget", "0", "--site", site, plant=plant)
    assert verdicts.get("m000") == "CORRECT", output[-4000:]
    assert verdicts.get("m001") == expected, output[-4000:]
    assert status == 1, output[-2000:]
