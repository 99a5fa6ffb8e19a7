"""Fault plans: which external block loads fail, deterministically under a seed.

A decision depends only on (seed, step, request id, block index), never on the
order in which blocks are examined, so the reference engine and vLLM's scheduler
see the same failures for the same schedule.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmetrics.metrics import strict_json
from kvmetrics.metrics.files import FileRefused, read_text
from kvmetrics.metrics.text import short_repr, utf8_encodable


class FaultPlanError(ValueError):
    """A fault plan that cannot be used; the message names the problem."""


@dataclass(frozen=True, slots=True)
class ScriptedFailure:
    """Fail the load of block ``block_index`` of a request's block table.

    ``request_id`` or ``step`` left as None match any request or step.
    """

    block_index: int
    request_id: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class FaultPlan:
    #: Probability that each loaded block fails.
    rate: float = 0.0
    seed: int = 0
    scripted: tuple[ScriptedFailure, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not (isinstance(self.rate, int | float) and math.isfinite(self.rate)
                and 0.0 <= self.rate <= 1.0):
            raise FaultPlanError(f"fault rate must be within 0..1, got {self.rate!r}")

    @property
    def is_empty(self) -> bool:
        return self.rate == 0.0 and not self.scripted

    def fails(self, step: int, request_id: str, block_index: int) -> bool:
        for f in self.scripted:
            if (f.block_index == block_index
                    and (f.request_id is None or f.request_id == request_id)
                    and (f.step is None or f.step == step)):
                return True
        if self.rate <= 0.0:
            return False
        if self.rate >= 1.0:
            return True
        digest = hashlib.blake2b(
            f"{self.seed}|{step}|{request_id}|{block_index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64 < self.rate

    # -- files ---------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any) -> FaultPlan:
        if not isinstance(data, dict):
            raise FaultPlanError("fault plan must be a JSON object")
        unknown = set(data) - {"rate", "seed", "failures"}
        if unknown:
            raise FaultPlanError(
                f"fault plan has unknown field(s): {', '.join(map(repr, sorted(unknown)))}")
        rate = data.get("rate", 0.0)
        seed = data.get("seed", 0)
        if isinstance(rate, bool) or not isinstance(rate, int | float):
            raise FaultPlanError(f"fault plan 'rate' must be a number, got {short_repr(rate, 60)}")
        if not 0 <= rate <= 1:  # compared before float(): 10**400 has no float
            raise FaultPlanError(f"fault rate must be within 0..1, got {short_repr(rate, 60)}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise FaultPlanError(
                f"fault plan 'seed' must be an integer, got {short_repr(seed, 60)}")
        failures = data.get("failures", [])
        if not isinstance(failures, list):
            raise FaultPlanError("fault plan 'failures' must be a list")
        scripted = []
        for i, item in enumerate(failures):
            if not isinstance(item, dict) or "block" not in item:
                raise FaultPlanError(f"fault plan failure #{i} needs a 'block' index")
            extra = set(item) - {"block", "request", "step"}
            if extra:
                raise FaultPlanError(f"fault plan failure #{i} has unknown field(s): "
                                     f"{', '.join(map(repr, sorted(extra)))}")
            block, request, step = item["block"], item.get("request"), item.get("step")
            if isinstance(block, bool) or not isinstance(block, int) or block < 0:
                raise FaultPlanError(f"fault plan failure #{i}: 'block' must be an integer >= 0")
            if request is not None and (not isinstance(request, str)
                                        or not utf8_encodable(request)):
                raise FaultPlanError(f"fault plan failure #{i}: 'request' must be a string")
            if step is not None and (isinstance(step, bool) or not isinstance(step, int)
                                     or step < 1):
                raise FaultPlanError(f"fault plan failure #{i}: 'step' must be an integer >= 1")
            scripted.append(ScriptedFailure(block, request, step))
        return cls(rate=float(rate), seed=seed, scripted=tuple(scripted))

    @classmethod
    def load(cls, path: str | Path) -> FaultPlan:
        try:
            # A regular file of bounded size: a FIFO or /dev/zero is refused, not read.
            text = read_text(str(path), "fault plan")
        except FileRefused as e:
            raise FaultPlanError(str(e)) from None
        try:
            data = strict_json.loads(text)
        except json.JSONDecodeError as e:
            raise FaultPlanError(f"fault plan {path}: bad JSON at line {e.lineno}: {e.msg}") \
                from None
        except strict_json.JSONRefused as e:
            raise FaultPlanError(f"fault plan {path}: {e}") from None
        except RecursionError:
            raise FaultPlanError(f"fault plan {path}: JSON nested too deeply") from None
        return cls.from_dict(data)

