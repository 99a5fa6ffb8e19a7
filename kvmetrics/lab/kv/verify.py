"""The verifier's vocabulary: findings, the strict-mode error, and who gets verified.

A *finding* is one block of KV that a request read in a step whose output the
engine keeps, and that differs from the ground truth for that request's prefix
(:mod:`kvmetrics.lab.kv.ground_truth`). One finding per mismatching block keeps the
count meaningful: a stale 16-token block is one bad read, not 16.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from dataclasses import dataclass

import torch

VERIFY_MODES = ("full", "sampled", "off")


@dataclass(frozen=True, slots=True)
class Finding:
    """A request read KV that a clean computation would not have produced."""

    request_id: str
    #: The physical block the bad KV was read from ...
    block_id: int
    #: ... and its index in the request's block table.
    block_index: int
    #: Positions (in the request) of the first and one past the last bad token
    #: of that block.
    token_start: int
    token_end: int
    step: int

    def __str__(self) -> str:
        return (f"step {self.step}: request {self.request_id!r} read bad KV in block "
                f"{self.block_id} (#{self.block_index}), tokens [{self.token_start}, "
                f"{self.token_end})")


class KVVerificationError(AssertionError):
    """Strict mode: a request whose output is kept attended over bad KV."""

    def __init__(self, findings: list[Finding]) -> None:
        self.findings = list(findings)
        head = "; ".join(str(f) for f in self.findings[:3])
        more = f" (+{len(self.findings) - 3} more)" if len(self.findings) > 3 else ""
        super().__init__(f"{len(self.findings)} KV verification failure(s): {head}{more}")


class VerifySelector:
    """Decides which scheduled requests a step verifies.

    ``sampled`` picks each (step, request) with probability ``fraction`` from a
    hash of (seed, step, request id): the choice repeats run to run and does not
    depend on batch order.
    """

    def __init__(self, mode: str = "full", fraction: float = 0.25, seed: int = 0) -> None:
        if mode not in VERIFY_MODES:
            raise ValueError(f"verify mode must be one of {VERIFY_MODES}, got {mode!r}")
        if not (isinstance(fraction, int | float) and 0.0 <= fraction <= 1.0):
            raise ValueError(f"verify fraction must be within 0..1, got {fraction!r}")
        self.mode = mode
        self.fraction = float(fraction)
        self.seed = seed

    def __call__(self, step: int, request_id: str) -> bool:
        if self.mode == "full":
            return True
        if self.mode == "off" or self.fraction <= 0.0:
            return False
        digest = hashlib.blake2b(f"{self.seed}|{step}|{request_id}".encode(),
                                 digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2**64 < self.fraction


@dataclass(slots=True)
class ReadSpan:
    """One verified request's read: positions ``0..end-1`` through its block table."""

    request_id: str
    block_ids: list[int]
    end: int


def findings_from_mask(ok: torch.Tensor, spans: list[ReadSpan], block_size: int,
                       step: int) -> list[Finding]:
    """Group the rows that failed (``ok`` False) into one finding per (request, block).

    ``ok`` holds one flag per token row of ``spans`` laid end to end. This runs
    only when something mismatched, so a Python pass over the bad rows is fine.
    """
    bad = (~ok).nonzero().flatten().tolist()
    if not bad:
        return []
    starts: list[int] = []
    total = 0
    for span in spans:
        starts.append(total)
        total += span.end
    ranges: dict[tuple[int, int], list[int]] = {}
    for row in bad:
        i = bisect_right(starts, row) - 1
        pos = row - starts[i]
        key = (i, pos // block_size)
        r = ranges.get(key)
        if r is None:
            ranges[key] = [pos, pos + 1]
        else:
            r[1] = pos + 1
    return [Finding(spans[i].request_id, spans[i].block_ids[idx], idx, lo, hi, step)
            for (i, idx), (lo, hi) in sorted(ranges.items())]
