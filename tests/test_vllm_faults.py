"""FaultInjectingConnector's settings, fault plan and KV poisoning, without a server.

The connector inside a real ``vllm serve`` is tested in tests/test_serve_recompute.py,
tests/test_serve_fail.py and tests/test_serve_stale.py.
"""

from __future__ import annotations

import pytest
import torch

from kvmetrics.faults.fault_plan import (
    FaultConfigError,
    FaultPlan,
    parse_settings,
    poison_blocks,
)

pytestmark = pytest.mark.vllm

BASE = {"inner_connector": "ExampleConnector"}


@pytest.mark.parametrize(("extra", "key"), [
    ({}, "inner_connector"),
    ({"inner_connector": ""}, "inner_connector"),
    ({"inner_connector": "FaultInjectingConnector"}, "inner_connector"),
    ({**BASE, "fault_rate": 1.5}, "fault_rate"),
    ({**BASE, "fault_rate": "0.1"}, "fault_rate"),
    ({**BASE, "fault_rate": float("nan")}, "fault_rate"),
    ({**BASE, "fault_seed": 1.5}, "fault_seed"),
    ({**BASE, "fault_loads": [0]}, "fault_loads"),
    ({**BASE, "fault_loads": 3}, "fault_loads"),
    ({**BASE, "fault_block": "last"}, "fault_block"),
    ({**BASE, "fault_mode": "sometimes"}, "fault_mode"),
    ({**BASE, "async_steps": 0}, "async_steps"),
    ({**BASE, "inner_extra_config": []}, "inner_extra_config"),
    ({**BASE, "inner_module_path": 7}, "inner_module_path"),
    ({**BASE, "fault_rat": 0.1}, "fault_rat"),
])
def test_a_bad_setting_is_one_line_naming_its_key(extra: dict, key: str) -> None:
    with pytest.raises(FaultConfigError) as info:
        parse_settings(extra)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"FaultInjectingConnector: kv_connector_extra_config.{key}: ")


def test_defaults_and_a_full_setting() -> None:
    s = parse_settings(BASE)
    assert (s.fault_rate, s.fault_seed, s.fault_loads, s.fault_block, s.fault_mode,
            s.async_steps, s.inner_extra_config) == (0.0, 0, frozenset(), None, "inner", 1, {})
    s = parse_settings({**BASE, "inner_extra_config": {"shared_storage_path": "/x"},
                        "fault_rate": 0.25, "fault_seed": 3, "fault_loads": [2, 5],
                        "fault_block": -1, "fault_mode": "async", "async_steps": 3})
    assert s.fault_loads == {2, 5} and s.fault_block == -1 and s.async_steps == 3


def test_the_plan_is_a_pure_function_of_seed_and_load_number() -> None:
    plan = FaultPlan(parse_settings({**BASE, "fault_rate": 0.3, "fault_seed": 11}))
    first = [plan.failing_block(n, 4) for n in range(1, 2001)]
    again = [FaultPlan(parse_settings({**BASE, "fault_rate": 0.3, "fault_seed": 11}))
             .failing_block(n, 4) for n in range(1, 2001)]
    assert first == again
    share = sum(b is not None for b in first) / len(first)
    assert 0.26 < share < 0.34
    assert {b for b in first if b is not None} == {0, 1, 2, 3}
    other = [FaultPlan(parse_settings({**BASE, "fault_rate": 0.3, "fault_seed": 12}))
             .failing_block(n, 4) for n in range(1, 2001)]
    assert other != first


def test_mixed_mode_draws_both_ways_from_the_seed() -> None:
    plan = FaultPlan(parse_settings({**BASE, "fault_rate": 1.0, "fault_mode": "mixed"}))
    ways = [plan.emulates_async(n) for n in range(1, 401)]
    assert 0.4 < sum(ways) / len(ways) < 0.6
    assert ways == [FaultPlan(plan.settings).emulates_async(n) for n in range(1, 401)]
    assert FaultPlan(parse_settings({**BASE, "fault_mode": "async"})).emulates_async(3)
    assert not FaultPlan(parse_settings(BASE)).emulates_async(3)


def test_explicit_targets_and_block_index() -> None:
    plan = FaultPlan(parse_settings({**BASE, "fault_loads": [2, 4], "fault_block": 1}))
    assert [plan.failing_block(n, 3) for n in range(1, 6)] == [None, 1, None, 1, None]
    last = FaultPlan(parse_settings({**BASE, "fault_loads": [1], "fault_block": -1}))
    assert last.failing_block(1, 3) == 2
    assert last.failing_block(1, 0) is None  # a load of no whole block has nothing to fail
    clamp = FaultPlan(parse_settings({**BASE, "fault_loads": [1], "fault_block": 9}))
    assert clamp.failing_block(1, 3) == 2


def test_poison_overwrites_the_failed_blocks_of_every_layer_and_nothing_else() -> None:
    num_blocks = 6
    caches = {f"layer.{i}": torch.zeros(num_blocks, 2, 4, 8) for i in range(2)}
    assert poison_blocks(caches, [4, 1], num_blocks) == []
    for t in caches.values():
        assert torch.isfinite(t).all()  # NaN would leak through masked attention slots
        assert t[[1, 4]].abs().mean() > 10  # far from any real K/V
        assert (t[[0, 2, 3, 5]] == 0).all()
    again = {"l": torch.zeros(num_blocks, 2, 4, 8)}
    poison_blocks(again, [4], num_blocks)
    assert torch.equal(again["l"][4], caches["layer.0"][4])  # seeded: repeatable
    kv_first = {"l": torch.zeros(2, num_blocks, 8)}
    assert poison_blocks(kv_first, [2], num_blocks) == []
    assert (kv_first["l"][:, 2] != 0).all() and (kv_first["l"][:, 3] == 0).all()
    ints = {"l": torch.zeros(num_blocks, 4, dtype=torch.int8)}
    poison_blocks(ints, [0], num_blocks)
    assert (ints["l"][1:] == 0).all() and ints["l"][0].abs().max() > 10
    odd = {"weird": torch.zeros(3, 3)}
    assert poison_blocks(odd, [1], num_blocks) == ["weird"]
    assert (odd["weird"] == 0).all()
