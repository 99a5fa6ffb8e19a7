"""A short soak in CI: random scenarios stay clean in the unified accounting."""

from __future__ import annotations

import json

from kvmetrics.lab.soak import soak
from tests.lab_support import run_cli


def test_short_soak_is_clean() -> None:
    report = soak(60, verify="off", seed=1000)
    assert report.scenarios == 60
    assert report.as_dict()["failing_seeds"] == []
    assert report.errors == report.invariant_violations == report.guard_rejected_increments == 0


def test_historical_soak_finds_violations() -> None:
    report = soak(60, verify="off", accounting="historical", seed=1000)
    assert report.guard_rejected_increments > 0
    assert report.errors == 0


def test_soak_command() -> None:
    result = run_cli("soak", "--scenarios", "5", "--verify", "off", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["scenarios"] == 5
    bad = run_cli("soak", "--engines", "reference,tpu")
    assert bad.returncode == 2 and "unknown engine 'tpu'" in bad.stderr


def test_verified_soak_finds_vllms_stale_reads_and_the_evicting_recovery_fixes_them() -> None:
    # Seed 66: policy recompute, mixed loads, preemption and aborts (docs/vllm.md).
    faithful = soak(1, verify="full", seed=66)
    assert faithful.verification_failed_blocks > 0
    assert faithful.invariant_violations == faithful.guard_rejected_increments == 0
    fixed = soak(12, verify="full", seed=60, recovery="evict")
    assert fixed.as_dict()["failing_seeds"] == []
