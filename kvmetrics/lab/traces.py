"""Trace files: kvmetrics' own JSONL format and the Mooncake FAST'25 format.

kvmetrics JSONL, one request per line::

    {"id": "r1", "arrival_s": 0.5, "prompt_token_ids": [1, 2, 3], "output_length": 16}
    {"arrival_s": 0.7, "prefix_block_ids": [7, 8], "prompt_length": 700,
     "block_tokens": 512, "output_length": 16}

A prompt is either explicit token ids, or prefix block ids plus a length: block
``b`` stands for ``block_tokens`` tokens that are a pure function of ``b``, so
equal leading ids mean a shared prefix (``id`` is optional; ``block_tokens``
defaults to 512).

Mooncake (``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``
of 512-token blocks) maps onto the second form. Because tokens derive from
(block id, offset), the sharing structure survives any engine block size.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvmetrics.lab.engine.tokens import VOCAB_SIZE, BlockSeededTokens, ExplicitTokens, PromptTokens
from kvmetrics.lab.workload import WorkItem
from kvmetrics.metrics import strict_json
from kvmetrics.metrics.files import FileRefused, open_regular
from kvmetrics.metrics.text import utf8_encodable

FORMATS = ("kvmetrics", "mooncake")
MOONCAKE_BLOCK_TOKENS = 512
#: Bounds that no real trace reaches (a 10M-token prompt, a request a year in), so an
#: absurd number is refused with its line instead of overflowing later.
MAX_TOKENS = 10_000_000
MAX_ARRIVAL_S = 365 * 24 * 3600.0
MAX_ID_CHARS = 200
#: A trace is streamed, so these bound what one line and the whole file may take: a
#: 2 GB file of zeros (one endless line) is refused at its first line, not read whole.
MAX_TRACE_BYTES = 2**30
MAX_LINE_BYTES = 16 * 2**20
#: Fields that only a Mooncake record has: a hint when one is read as kvmetrics JSONL.
MOONCAKE_FIELDS = frozenset({"timestamp", "input_length", "hash_ids"})


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, line and problem."""


def load_trace(path: str | Path, fmt: str = "kvmetrics",
               max_requests: int | None = None) -> list[WorkItem]:
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r} (choose from {', '.join(FORMATS)})")
    parse = _parse_kvmetrics if fmt == "kvmetrics" else _parse_mooncake
    items: list[WorkItem] = []
    first_line: dict[str, int] = {}
    for lineno, record in _records(Path(path)):
        if max_requests is not None and len(items) >= max_requests:
            break
        item = parse(record, len(items), f"{path}:{lineno}")
        # Refused here, with both lines, not as an engine's error halfway through the run.
        seen = first_line.setdefault(item.request_id, lineno)
        if seen != lineno:
            raise TraceError(f"{path}:{lineno}: duplicate request id "
                             f"{item.request_id[:60]!r} (first on line {seen})")
        items.append(item)
    if not items:
        raise TraceError(f"{path}: the trace holds no requests")
    return items


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """The trace's JSON objects with their line numbers, read from a regular file (a FIFO
    or /dev/zero is refused), each line at most MAX_LINE_BYTES."""
    try:
        handle = open_regular(str(path), "trace", MAX_TRACE_BYTES)
    except FileRefused as e:
        raise TraceError(str(e)) from None
    with handle:
        lineno = 0
        while raw := handle.readline(MAX_LINE_BYTES + 1):
            lineno += 1
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(f"{path}:{lineno}: line longer than {MAX_LINE_BYTES:,} bytes")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise TraceError(f"{path}:{lineno}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                record = strict_json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{lineno}: bad JSON ({e.msg})") from None
            except strict_json.JSONRefused as e:
                raise TraceError(f"{path}:{lineno}: {e}") from None
            except RecursionError:
                raise TraceError(f"{path}:{lineno}: JSON nested too deeply") from None
            if not isinstance(record, dict):
                raise TraceError(f"{path}:{lineno}: each line must be a JSON object")
            yield lineno, record


def _int(record: dict[str, Any], key: str, where: str, minimum: int = 0) -> int:
    if key not in record:
        raise TraceError(f"{where}: missing field {key!r}")
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: {key!r} must be an integer, got {repr(value)[:40]}")
    if value < minimum:
        raise TraceError(f"{where}: {key!r} must be >= {minimum}, got {value}")
    if value > MAX_TOKENS:
        raise TraceError(f"{where}: {key!r} is absurdly large (over {MAX_TOKENS:,})")
    return value


def _number(record: dict[str, Any], key: str, where: str, scale: float = 1.0) -> float:
    if key not in record:
        raise TraceError(f"{where}: missing field {key!r}")
    value = record[key]
    # Compared, never converted first: 10**400 has no float, and NaN fails both bounds.
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not 0 <= value <= scale * MAX_ARRIVAL_S:
        raise TraceError(f"{where}: {key!r} must be a number from 0 to a year "
                         f"({scale * MAX_ARRIVAL_S:g}), got {repr(value)[:40]}")
    return float(value)


def _block_prompt(block_ids: Any, length: int, unit: int, where: str,
                  field: str) -> PromptTokens:
    if not isinstance(block_ids, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids):
        raise TraceError(f"{where}: {field!r} must be a list of integers >= 0")
    if len(block_ids) != math.ceil(length / unit):
        raise TraceError(
            f"{where}: {len(block_ids)} {field} do not match a length of {length} tokens "
            f"at {unit} tokens a block (expected {math.ceil(length / unit)})")
    return BlockSeededTokens(block_ids, length, unit)


def _parse_kvmetrics(record: dict[str, Any], index: int, where: str) -> WorkItem:
    known = {"id", "arrival_s", "prompt_token_ids", "prefix_block_ids", "prompt_length",
             "block_tokens", "output_length"}
    unknown = set(record) - known
    if unknown:
        hint = ("; this looks like a Mooncake trace: add --trace-format mooncake"
                if unknown & MOONCAKE_FIELDS else "")
        names = ", ".join(repr(name)[:40] for name in sorted(unknown)[:5])
        raise TraceError(f"{where}: unknown field(s) {names}{hint}")
    rid = record.get("id", f"req-{index:06d}")
    if not isinstance(rid, str) or not rid or len(rid) > MAX_ID_CHARS \
            or not rid.isprintable() or not utf8_encodable(rid):
        raise TraceError(f"{where}: 'id' must be a non-empty string of at most "
                         f"{MAX_ID_CHARS} printable characters (valid Unicode)")
    arrival = _number(record, "arrival_s", where)
    output = _int(record, "output_length", where, minimum=1)
    prompt: PromptTokens
    if "prompt_token_ids" in record:
        ids = record["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < VOCAB_SIZE
                for t in ids):
            raise TraceError(f"{where}: 'prompt_token_ids' must be a non-empty list of "
                             f"integers in 0..{VOCAB_SIZE - 1}")
        prompt = ExplicitTokens(ids)
    elif "prefix_block_ids" in record:
        length = _int(record, "prompt_length", where, minimum=1)
        unit = _int(record, "block_tokens", where, minimum=1) if "block_tokens" in record \
            else MOONCAKE_BLOCK_TOKENS
        prompt = _block_prompt(record["prefix_block_ids"], length, unit, where,
                               "prefix_block_ids")
    else:
        raise TraceError(f"{where}: missing field 'prompt_token_ids' or 'prefix_block_ids'")
    return WorkItem(rid, arrival, prompt, output, stop_on_eos=False)


def _parse_mooncake(record: dict[str, Any], index: int, where: str) -> WorkItem:
    timestamp_ms = _number(record, "timestamp", where, scale=1000.0)
    length = _int(record, "input_length", where, minimum=1)
    output = _int(record, "output_length", where, minimum=1)
    if "hash_ids" not in record:
        raise TraceError(f"{where}: missing field 'hash_ids'")
    prompt = _block_prompt(record["hash_ids"], length, MOONCAKE_BLOCK_TOKENS, where, "hash_ids")
    return WorkItem(f"mc-{index:06d}", timestamp_ms / 1000.0, prompt, output, stop_on_eos=False)

