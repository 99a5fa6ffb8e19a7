"""Settings, fault plan and KV poison of :mod:`kvmetrics.faults.connector`.

Kept apart from the connector so they can be read (and tested) without vLLM's
connector machinery: which loads fail is a pure function of the settings and the
load number, and the poison is a pure function of the block id.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

PREFIX = "FaultInjectingConnector: kv_connector_extra_config"
FAULT_MODES = ("inner", "async", "mixed")


class FaultConfigError(ValueError):
    """A bad ``kv_connector_extra_config`` setting; the message is one line naming it."""


@dataclass(frozen=True)
class FaultSettings:
    inner_connector: str
    inner_module_path: str | None = None
    inner_extra_config: dict[str, Any] = field(default_factory=dict)
    fault_rate: float = 0.0
    fault_seed: int = 0
    fault_loads: frozenset[int] = frozenset()
    fault_block: int | None = None
    fault_mode: str = "inner"
    async_steps: int = 1


def fail(key: str, problem: str) -> FaultConfigError:
    """The error for a bad ``key``: one line, naming it."""
    return FaultConfigError(f"{PREFIX}.{key}: {problem}")


def _int(extra: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value: object = extra.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(key, f"must be an integer, got {value!r}")
    return value


def parse_settings(extra: Mapping[str, Any] | None) -> FaultSettings:
    """Validate the wrapper's extra config; raises FaultConfigError naming the bad key."""
    extra = dict(extra or {})
    known = {f.name for f in dataclasses.fields(FaultSettings)}
    for key in extra:
        if key not in known:
            raise fail(key, f"unknown setting (known: {', '.join(sorted(known))})")
    inner = extra.get("inner_connector")
    if not isinstance(inner, str) or not inner:
        raise fail("inner_connector", f"must name the connector to wrap, got {inner!r}")
    if inner == "FaultInjectingConnector":
        raise fail("inner_connector", "cannot wrap FaultInjectingConnector itself")
    module = extra.get("inner_module_path")
    if module is not None and (not isinstance(module, str) or not module):
        raise fail("inner_module_path", f"must be a module name, got {module!r}")
    inner_extra = extra.get("inner_extra_config", {})
    if not isinstance(inner_extra, dict):
        raise fail("inner_extra_config", f"must be an object, got {inner_extra!r}")
    rate = extra.get("fault_rate", 0.0)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1 \
            or math.isnan(rate):
        raise fail("fault_rate", f"must be a number from 0 to 1, got {rate!r}")
    seed = _int(extra, "fault_seed", 0)
    loads = extra.get("fault_loads", [])
    if not isinstance(loads, list) or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in loads):
        raise fail("fault_loads", f"must be a list of load numbers >= 1, got {loads!r}")
    block = _int(extra, "fault_block", None)
    mode = extra.get("fault_mode", "inner")
    if mode not in FAULT_MODES:
        raise fail("fault_mode", f"must be one of {', '.join(FAULT_MODES)}, got {mode!r}")
    steps = _int(extra, "async_steps", 1)
    if steps is None or steps < 1:
        raise fail("async_steps", f"must be an integer >= 1, got {steps!r}")
    return FaultSettings(inner, module, dict(inner_extra), float(rate), int(seed or 0),
                         frozenset(loads), block, mode, steps)


class FaultPlan:
    """Which loads fail and at which block: a pure function of the settings and the number."""

    def __init__(self, settings: FaultSettings) -> None:
        self.settings = settings

    def fails(self, number: int) -> bool:
        s = self.settings
        if number in s.fault_loads:
            return True
        return s.fault_rate > 0 and self._rng(number).random() < s.fault_rate

    def failing_block(self, number: int, num_blocks: int) -> int | None:
        """Index (into the load's blocks) of the block that fails, or None."""
        if num_blocks <= 0 or not self.fails(number):
            return None
        block = self.settings.fault_block
        if block is None:
            rng = self._rng(number)
            rng.random()  # the draw that decided the failure
            return rng.randrange(num_blocks)
        index = block if block >= 0 else num_blocks + block
        return min(max(index, 0), num_blocks - 1)

    def emulates_async(self, number: int) -> bool:
        """Whether failing load ``number`` is turned into a wrapper-finished async load."""
        mode = self.settings.fault_mode
        if mode != "mixed":
            return mode == "async"
        rng = self._rng(number)
        rng.random()
        rng.random()
        return rng.random() < 0.5

    def _rng(self, number: int) -> random.Random:
        return random.Random(self.settings.fault_seed * 1_000_003 + number)


@dataclass(frozen=True)
class InjectedFault:
    """One load the workers must fail: its number, request, failed block ids, mode."""

    number: int
    request_id: str
    block_ids: tuple[int, ...]
    #: "sync", "async" (the inner connector's own async load) or "emulated".
    mode: str


#: Scale of the noise written into failed blocks: far outside what a model's K/V hold,
#: so a request that reads a poisoned block as context is thrown off visibly.
POISON_SCALE = 64.0


def poison_blocks(kv_caches: Mapping[str, torch.Tensor], block_ids: Iterable[int],
                  num_blocks: int) -> list[str]:
    """Overwrite the given blocks of every layer with large seeded noise.

    Finite on purpose: NaN would also corrupt *other* requests, because attention
    kernels multiply the masked (unused) slots of a block by a zero weight and
    0 x NaN is NaN; a block freed after the failed step keeps NaN-derived values in
    slots the next owner has not written yet (seen on vLLM's CPU attention). A real
    failed load leaves finite garbage, so finite noise rehearses exactly that.
    vLLM's per-layer KV views put the block index first (``[blocks, ...]``); a
    layer laid out otherwise is left alone and its name returned.
    """
    ids = sorted(set(block_ids))
    skipped: list[str] = []
    if not ids:
        return skipped
    for name, tensor in kv_caches.items():
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            skipped.append(name)
            continue
        dim = 0 if tensor.shape[0] == num_blocks else (
            1 if tensor.dim() > 1 and tensor.shape[1] == num_blocks else None)
        if dim is None or ids[-1] >= tensor.shape[dim]:
            skipped.append(name)
            continue
        for block in ids:
            view = tensor.select(dim, block)
            gen = torch.Generator().manual_seed(1_000_003 * block + 17)
            noise = torch.randn(view.shape, generator=gen) * POISON_SCALE
            if not tensor.dtype.is_floating_point:
                info = torch.iinfo(tensor.dtype)
                noise = noise.round().clamp(info.min, info.max)
            view.copy_(noise.to(dtype=tensor.dtype, device=tensor.device))
    return skipped
