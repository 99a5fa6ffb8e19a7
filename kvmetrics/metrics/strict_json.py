"""JSON read and written strictly: standard JSON only, every number bounded.

Python's ``json`` accepts and writes ``NaN`` and ``Infinity`` (not JSON: other tools
refuse the file), turns ``1e400`` into infinity, and raises a bare ``ValueError``
for an integer of more than 4,300 digits. Files kvmetrics reads from users go
through :func:`loads`, files it writes through :func:`dumps`.

A JSON file can also be small and huge once parsed: ``{},`` is three bytes and a
64-byte dict, so ``[{},{},...]`` takes 26 times its size in memory (a file under the
256 MB input cap, 6 GB). :func:`loads` counts the brackets that open objects and
lists before parsing (a count over the text, no objects made; brackets inside
strings count too, so it errs on refusing) and refuses a text whose containers would
take more than :data:`MAX_CONTAINER_BYTES_PER_BYTE` times its size, above a small
floor. Scalars cannot amplify as much (a number or a string takes at most about 8
times its spelling), so a text that passes takes at most about 12 times its size.
"""

from __future__ import annotations

import json
import math
from typing import Any

#: Digits an integer in an input file may have: far more than any valid field takes
#: (each field then says what it accepts), far fewer than Python refuses to convert.
MAX_INT_DIGITS = 1000
#: What one parsed container costs, in bytes (CPython 3.11-3.13: an empty list is 56
#: bytes, a dict with one to five keys 184, plus its slot of 8 in the container that
#: holds it).
OBJECT_BYTES, LIST_BYTES = 192, 64
#: Containers may take at most this many times the text's size (kvmetrics' own files
#: have far fewer: a run's JSON about 0.2 times, a soak report about 1.5 times) ...
MAX_CONTAINER_BYTES_PER_BYTE = 4
#: ... or this much, whichever is more: a small file is never refused for its shape.
CONTAINER_BYTES_FLOOR = 8 * 2**20


class JSONRefused(ValueError):
    """Valid-looking JSON that kvmetrics does not read; the message is one line."""


def _int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise JSONRefused(f"an integer of {digits:,} digits (at most {MAX_INT_DIGITS:,})")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONRefused(f"number {text[:24]} is out of range")
    return value


def _constant(name: str) -> Any:
    raise JSONRefused(f"{name} is not a JSON number")


def _check_amplification(text: str | bytes) -> None:
    if isinstance(text, str):
        objects, lists = text.count("{"), text.count("[")
    else:
        objects, lists = text.count(b"{"), text.count(b"[")
    cost = objects * OBJECT_BYTES + lists * LIST_BYTES
    if cost > max(MAX_CONTAINER_BYTES_PER_BYTE * len(text), CONTAINER_BYTES_FLOOR):
        raise JSONRefused(f"{objects:,} objects and {lists:,} lists in {len(text):,} "
                          f"characters would take about {cost / 2**20:,.0f} MB once read "
                          f"(refused: at most {MAX_CONTAINER_BYTES_PER_BYTE} times the "
                          "file's size)")


def loads(text: str | bytes) -> Any:
    """``json.loads`` refusing NaN, Infinity, numbers out of float range, integers over
    :data:`MAX_INT_DIGITS` digits and texts whose objects and lists would take many
    times their size in memory (:class:`JSONRefused`); bad JSON still raises
    ``json.JSONDecodeError`` and deep nesting ``RecursionError``."""
    _check_amplification(text)
    return json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None: a number that could
    not be computed is absent, never a token other tools refuse."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`finite` ``(value)``: always standard JSON."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)
