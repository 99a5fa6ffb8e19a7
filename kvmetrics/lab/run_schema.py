"""The run document's schema, checked in full before anything of it is drawn.

``kvmetrics report RUN.json`` reads a file anyone may have edited or written. Every
field a run writes has one type (every list item too: a violation, a cause, a timeline
value), and a document with any other is refused with one line naming the field,
instead of failing somewhere in the drawing or putting a value of a type nobody
expected into the page. Fields a run may leave out (an older run, an unverified one)
may be missing; what is there is checked. Text is not limited here: the page escapes
every value (:mod:`kvmetrics.lab.markup`).
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable
from typing import Any

#: A check: raises RunDocumentError naming ``where`` if ``value`` does not fit.
Check = Callable[[Any, str], None]

#: Largest count a run writes is far below this; a bigger one is an edited file (and
#: Python refuses to print ints of more than 4300 digits).
MAX_COUNT = 2**63
#: A run's timeline has at most a few hundred buckets (timeline.DEFAULT_MAX_POINTS).
MAX_POINTS = 100_000


class RunDocumentError(ValueError):
    """A run document of the wrong shape; the message names the field."""


def _where(where: str) -> str:
    return repr(where or "document")


def count(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_COUNT:
        raise RunDocumentError(f"field {_where(where)} must be an integer >= 0")


def number(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not math.isfinite(value) or abs(value) >= MAX_COUNT:
        raise RunDocumentError(f"field {_where(where)} must be a number")


def text(value: Any, where: str) -> None:
    if not isinstance(value, str):
        raise RunDocumentError(f"field {_where(where)} must be a str")


def flag(value: Any, where: str) -> None:
    if not isinstance(value, bool):
        raise RunDocumentError(f"field {_where(where)} must be a bool")


def optional(check: Check) -> Check:
    def run(value: Any, where: str) -> None:
        if value is not None:
            check(value, where)
    return run


def one_of(*allowed: str) -> Check:
    def run(value: Any, where: str) -> None:
        if value not in allowed:
            raise RunDocumentError(f"field {_where(where)} must be one of {', '.join(allowed)}")
    return run


def list_of(check: Check, limit: int = MAX_POINTS) -> Check:
    def run(value: Any, where: str) -> None:
        if not isinstance(value, list):
            raise RunDocumentError(f"field {_where(where)} must be a list")
        if len(value) > limit:
            raise RunDocumentError(f"field {_where(where)} has {len(value):,} items "
                                   f"(at most {limit:,})")
        for i, item in enumerate(value):
            check(item, f"{where}[{i}]")
    return run


def map_of(check: Check, limit: int = 1000) -> Check:
    """An object with any keys (bounded in number), each value checked."""
    def run(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise RunDocumentError(f"field {_where(where)} must be an object")
        if len(value) > limit:
            raise RunDocumentError(f"field {_where(where)} has {len(value):,} entries "
                                   f"(at most {limit:,})")
        for key, item in value.items():
            check(item, f"{where}.{key}" if where else str(key))
    return run


def obj(fields: dict[str, Check], required: tuple[str, ...] = ()) -> Check:
    """An object with known fields: each there checked, ``required`` ones there, others
    (written by a later version) ignored, never shown."""
    def run(value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise RunDocumentError(f"field {_where(where)} must be an object")
        for key, check in fields.items():
            inner = f"{where}.{key}" if where else key
            if key in value:
                check(value[key], inner)
            elif key in required:
                raise RunDocumentError(f"the run document has no {inner!r} field")
    return run


def _like(template: Any) -> Check:
    """The check for a summary field from the value a run writes for it."""
    if isinstance(template, dict):
        return obj({k: _like(v) for k, v in template.items()})
    if isinstance(template, bool):
        return flag
    if isinstance(template, int):
        return count
    if isinstance(template, float):
        return number
    return text


def _summary_fields() -> dict[str, Check]:
    """A summary as a run writes it (of no events) gives each field's check."""
    from kvmetrics.lab.summary import build_summary
    from kvmetrics.metrics.totals import Totals

    template = build_summary(Totals(), engine="x", submitted=0, wall_seconds=0.0, steps=0)
    return {key: _like(value) for key, value in template.items()}


def _config_check(hint: Any) -> Check:
    """The check for a LabConfig field of type ``hint`` (str, int, float, bool, X | None)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [h for h in typing.get_args(hint) if h is not type(None)]
        return optional(_config_check(inner[0]))
    return {bool: flag, int: _signed_int, float: number, str: text}.get(hint, _scalar)


def _signed_int(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= MAX_COUNT:
        raise RunDocumentError(f"field {_where(where)} must be an integer")


def _scalar(value: Any, where: str) -> None:
    if value is not None and not isinstance(value, str | bool):
        number(value, where)


def _config_fields() -> Check:
    from kvmetrics.lab.config import LabConfig

    hints = typing.get_type_hints(LabConfig)
    known = {name: _config_check(hints[name]) for name in LabConfig.__dataclass_fields__}

    def run(value: Any, where: str) -> None:
        obj(known)(value, where)
        for key, item in value.items():  # a later version's setting: shown as it is
            if key not in known:
                _scalar(item, f"{where}.{key}")
    return run


CAUSE = obj({
    "cause": text, "known": flag, "explanation": text, "failed_blocks": count,
    "requests": count, "blocks": count, "first_step": optional(count), "example": text,
    "docs": optional(text), "avoid": optional(text),
}, required=("cause", "known", "explanation", "failed_blocks", "requests", "blocks",
             "first_step", "example", "docs", "avoid"))

VIOLATION = obj({
    "kind": one_of("guard_rejection", "invariant"), "metric": text, "reason": text,
    "invariant": optional(text), "count": count, "first_step": count,
    "first_request": optional(text), "examples": list_of(text, 100),
}, required=("kind", "metric", "count", "first_step", "first_request", "examples"))

FINDINGS = obj({
    "failed_blocks": count, "requests": count, "blocks": count,
    "first_step": optional(count), "causes": list_of(CAUSE, 100),
}, required=("failed_blocks", "requests", "blocks", "causes"))

TIMELINE = obj({
    "bucket_steps": count, "wall_s": list_of(number), "first_step": list_of(count),
    "last_step": list_of(count), "counters": map_of(list_of(number)),
    "gauges": map_of(list_of(number)),
}, required=("bucket_steps", "last_step", "counters", "gauges"))


def check_run_document(document: Any) -> None:
    """Raise RunDocumentError (one line, naming the field) unless ``document`` has the
    shape ``kvmetrics run --output`` writes."""
    if not isinstance(document, dict) or "timeline" not in document:
        raise RunDocumentError("the run document has no timeline (write it with "
                               "`kvmetrics run --output RUN.json`)")
    fields = _summary_fields()
    fields.update({
        "findings": FINDINGS, "violations": list_of(VIOLATION, 1000),
        "config": _config_fields(), "timeline": TIMELINE, "interrupted": optional(text),
        "stalled": optional(text), "stopped": optional(text),
    })
    obj(fields, required=("engine", "requests", "steps", "verification", "timeline"))(
        document, "")
    for v in document.get("violations") or ():  # the fields of its kind
        key = "reason" if v["kind"] == "guard_rejection" else "invariant"
        if key not in v:
            raise RunDocumentError(f"a {v['kind']} violation has no {key!r} field")
