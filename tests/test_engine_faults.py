"""Fault plans (which loads fail) and the external store index (where loads come from)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan, FaultPlanError, ScriptedFailure

GRID = [(step, f"req-{r}", idx) for step in range(1, 21) for r in range(10) for idx in range(10)]


def _decisions(plan: FaultPlan, grid: list[tuple[int, str, int]]) -> dict:
    return {key: plan.fails(*key) for key in grid}


# -- FaultPlan ------------------------------------------------------------------------


def test_decisions_depend_only_on_seed_step_request_and_block() -> None:
    plan = FaultPlan(rate=0.3, seed=42)
    first = _decisions(plan, GRID)
    shuffled = GRID[:]
    random.Random(1).shuffle(shuffled)
    assert _decisions(FaultPlan(rate=0.3, seed=42), shuffled) == first
    assert _decisions(FaultPlan(rate=0.3, seed=43), GRID) != first


@pytest.mark.parametrize("rate", [0.05, 0.3, 0.7])
def test_failure_share_follows_the_rate(rate: float) -> None:
    share = sum(_decisions(FaultPlan(rate=rate, seed=7), GRID).values()) / len(GRID)
    assert abs(share - rate) < 0.03  # 2000 seeded draws: deterministic, well within bounds


def test_rate_zero_never_fails_and_rate_one_always_fails() -> None:
    assert not any(_decisions(FaultPlan(rate=0.0), GRID).values())
    assert all(_decisions(FaultPlan(rate=1.0), GRID).values())
    assert FaultPlan().is_empty
    assert not FaultPlan(rate=0.1).is_empty


@pytest.mark.parametrize("rate", [-0.01, 1.01, float("nan"), float("inf"), "0.5", None])
def test_rates_outside_zero_to_one_are_refused(rate: object) -> None:
    with pytest.raises(FaultPlanError, match="fault rate must be within 0..1"):
        FaultPlan(rate=rate)  # type: ignore[arg-type]


def test_scripted_failures_match_block_and_optionally_request_and_step() -> None:
    plan = FaultPlan(scripted=(ScriptedFailure(1, "r"), ScriptedFailure(3, step=5),
                               ScriptedFailure(0, "q", 2)))
    assert plan.fails(9, "r", 1) and not plan.fails(9, "r", 2) and not plan.fails(9, "s", 1)
    assert plan.fails(5, "anyone", 3) and not plan.fails(6, "anyone", 3)
    assert plan.fails(2, "q", 0) and not plan.fails(3, "q", 0)
    assert not plan.is_empty


def test_plan_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"rate": 0.25, "seed": 9, "failures": [
        {"block": 1, "request": "r"}, {"block": 0, "step": 3}, {"block": 4}]}))
    plan = FaultPlan.load(path)
    assert plan == FaultPlan(rate=0.25, seed=9, scripted=(
        ScriptedFailure(1, "r"), ScriptedFailure(0, None, 3), ScriptedFailure(4)))
    assert FaultPlan.load(_write(tmp_path, "{}")) == FaultPlan()


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "message"), [
    ('{"rate": 0.1,\n "seed": }', r"bad JSON at line 2"),
    ("[1, 2]", "must be a JSON object"),
    ('{"rate": 0.1, "sed": 3}', r"unknown field\(s\): 'sed'"),
    ('{"rate": "high"}', "'rate' must be a number"),
    ('{"rate": true}', "'rate' must be a number"),
    ('{"rate": 2}', "fault rate must be within 0..1"),
    ('{"seed": 1.5}', "'seed' must be an integer"),
    ('{"failures": {"block": 1}}', "'failures' must be a list"),
    ('{"failures": [{"request": "r"}]}', "failure #0 needs a 'block' index"),
    ('{"failures": [{"block": 1}, {"block": -1}]}', r"failure #1: 'block' must be an integer"),
    ('{"failures": [{"block": false}]}', r"failure #0: 'block' must be an integer"),
    ('{"failures": [{"block": 1, "request": 5}]}', "'request' must be a string"),
    ('{"failures": [{"block": 1, "step": 0}]}', r"'step' must be an integer >= 1"),
    ('{"failures": [{"block": 1, "when": 2}]}', r"failure #0 has unknown field\(s\): 'when'"),
])
def test_bad_plan_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(FaultPlanError, match=message):
        FaultPlan.load(_write(tmp_path, text))


def test_missing_plan_file_is_a_fault_plan_error(tmp_path: Path) -> None:
    with pytest.raises(FaultPlanError, match="cannot read fault plan .*nope.json"):
        FaultPlan.load(tmp_path / "nope.json")


# -- ExternalStoreIndex ---------------------------------------------------------------


def _h(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def test_store_evicts_the_least_recently_used_block_and_reuses_its_slot() -> None:
    store = ExternalStoreIndex(3)
    slots = {name: store.insert(_h(name)) for name in "abc"}
    assert sorted(slots.values()) == [0, 1, 2]
    assert store.lookup(_h("a")) == slots["a"]  # a is now the most recent

    slot_d = store.insert(_h("d"))
    assert _h("b") not in store
    assert slot_d == slots["b"]
    assert store.evictions == 1
    assert len(store) == 3
    assert store.lookup(_h("b")) is None

    store.insert(_h("e"))  # c is the least recent now
    assert _h("c") not in store and _h("a") in store


def test_inserting_a_stored_block_refreshes_it_without_a_new_slot() -> None:
    store = ExternalStoreIndex(2)
    slot_a = store.insert(_h("a"))
    store.insert(_h("b"))
    assert store.insert(_h("a")) == slot_a
    store.insert(_h("c"))
    assert _h("b") not in store and _h("a") in store
    assert store.evictions == 1


def test_membership_probe_does_not_count_as_use() -> None:
    store = ExternalStoreIndex(2)
    store.insert(_h("a"))
    store.insert(_h("b"))
    assert _h("a") in store
    store.insert(_h("c"))
    assert _h("a") not in store


def test_discard_frees_the_slot_without_an_eviction() -> None:
    store = ExternalStoreIndex(2)
    store.insert(_h("a"))
    slot_b = store.insert(_h("b"))
    store.discard(_h("b"))
    store.discard(_h("b"))  # discarding twice is harmless
    assert store.insert(_h("c")) == slot_b
    assert store.evictions == 0
    assert len(store) == 2


def test_store_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="at least 1 block"):
        ExternalStoreIndex(0)
