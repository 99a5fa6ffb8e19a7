"""Prompt token sequences that need not be materialized to be hashed.

A replayed production trace holds about 145 million prompt tokens; building
Python lists of them would dominate a replay. A :class:`BlockSeededTokens`
prompt is described by the trace's block ids and a length: its tokens are a pure
function of (block id, offset), so the content key of any token range can be
written from the block ids alone, and tokens are generated only when the data
plane actually needs them.
"""

from __future__ import annotations

import functools
import struct
from array import array
from collections.abc import Sequence
from typing import Protocol

VOCAB_SIZE = 50_000
_MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread, process-independent integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class PromptTokens(Protocol):
    def __len__(self) -> int: ...

    def content_key(self, start: int, end: int) -> bytes:
        """Bytes that identify tokens[start:end] (equal keys iff equal tokens)."""
        ...

    def tokens(self, start: int, end: int) -> list[int]: ...


class ExplicitTokens:
    """A prompt given as token ids."""

    __slots__ = ("_ids",)

    def __init__(self, ids: Sequence[int]) -> None:
        self._ids = array("q", ids)

    def __len__(self) -> int:
        return len(self._ids)

    def content_key(self, start: int, end: int) -> bytes:
        return b"T" + self._ids[start:end].tobytes()

    def tokens(self, start: int, end: int) -> list[int]:
        return self._ids[start:end].tolist()


class BlockSeededTokens:
    """A prompt given as trace block ids of ``unit`` tokens each, plus a length.

    Token ``o`` of unit block ``b`` is ``mix64(b * 2**20 + o) % VOCAB_SIZE``; two
    prompts that share leading block ids share those tokens exactly, whatever
    block size the engine uses.
    """

    __slots__ = ("_units", "_length", "unit")

    def __init__(self, unit_ids: Sequence[int], length: int, unit: int = 512) -> None:
        if length > len(unit_ids) * unit or length <= (len(unit_ids) - 1) * unit:
            raise ValueError(
                f"{len(unit_ids)} blocks of {unit} tokens cannot hold {length} tokens")
        self._units = tuple(unit_ids)
        self._length = length
        self.unit = unit

    def __len__(self) -> int:
        return self._length

    def content_key(self, start: int, end: int) -> bytes:
        parts = [b"S"]
        pos = start
        while pos < end:
            idx, off = divmod(pos, self.unit)
            stop = min(end, (idx + 1) * self.unit)
            parts.append(struct.pack("<qII", self._units[idx], off, stop - idx * self.unit))
            pos = stop
        return b"".join(parts)

    def tokens(self, start: int, end: int) -> list[int]:
        out: list[int] = []
        pos = start
        while pos < end:
            idx, off = divmod(pos, self.unit)
            stop = min(end, (idx + 1) * self.unit)
            out.extend(_unit_tokens(self._units[idx], self.unit)[off:stop - idx * self.unit])
            pos = stop
        return out


@functools.lru_cache(maxsize=4096)
def _unit_tokens(unit_id: int, unit: int) -> tuple[int, ...]:
    """All tokens of one trace block; cached because traces share blocks heavily."""
    base = unit_id << 20
    return tuple(mix64(base + off) % VOCAB_SIZE for off in range(unit))


def output_key(tokens: Sequence[int]) -> bytes:
    return b"O" + array("q", tokens).tobytes()
