"""JSON read and written strictly: standard JSON only, every number bounded.

Python's ``json`` accepts and writes ``NaN`` and ``Infinity`` (not JSON: other tools
refuse the file), turns ``1e400`` into infinity, and raises a bare ``ValueError``
for an integer of more than 4,300 digits. Files kvmetrics reads from users go
through :func:`loads`, files it writes through :func:`dumps`.
"""

from __future__ import annotations

import json
import math
from typing import Any

#: Digits an integer in an input file may have: far more than any valid field takes
#: (each field then says what it accepts), far fewer than Python refuses to convert.
MAX_INT_DIGITS = 1000


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


def loads(text: str | bytes) -> Any:
    """``json.loads`` refusing NaN, Infinity, numbers out of float range and integers
    over :data:`MAX_INT_DIGITS` digits (:class:`JSONRefused`); bad JSON still raises
    ``json.JSONDecodeError`` and deep nesting ``RecursionError``."""
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
