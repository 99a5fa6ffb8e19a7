"""The name a Collector's Prometheus exporter gives an OTel metric (suffixes on).

The rules, as the OpenTelemetry/Prometheus compatibility specification and the
Collector's translator (github.com/prometheus/otlptranslator, "UnderscoreEscaping
WithSuffixes") apply them, re-expressed here for the tests:

1. the name is split into tokens at every character outside ``[a-zA-Z0-9:]``;
2. the unit's main part (before ``/``) is mapped (``s`` -> ``seconds``, ``By`` ->
   ``bytes``, ``1`` -> nothing, ...) unless it is empty or an annotation in
   braces, and appended as a token unless the name already has that token; a
   ``/x`` part becomes ``per_<x>`` the same way;
3. a monotonic sum gets ``total`` as its last token (moved there if present);
4. a gauge whose unit is exactly ``1`` gets ``ratio`` as its last token.
"""

from __future__ import annotations

import re

_UNITS = {"d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds",
          "us": "microseconds", "ns": "nanoseconds", "By": "bytes", "KiBy": "kibibytes",
          "MiBy": "mebibytes", "GiBy": "gibibytes", "%": "percent", "1": ""}
_PER = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week"}


def _unit_token(unit: str, table: dict[str, str]) -> str:
    unit = unit.strip()
    if not unit or "{" in unit or "}" in unit:
        return ""
    return table.get(unit, unit)


def prometheus_name(name: str, unit: str, kind: str) -> str:
    """``kind``: ``counter`` (monotonic sum), ``gauge`` or ``histogram``."""
    tokens = [t for t in re.split(r"[^a-zA-Z0-9:]+", name) if t]
    main, _, per = unit.partition("/")
    main_token = _unit_token(main, _UNITS)
    per_token = _unit_token(per, _PER)
    if main_token and main_token not in tokens:
        tokens.append(main_token)
    if per_token and f"per_{per_token}" not in tokens:
        tokens.append(f"per_{per_token}")
    if kind == "counter":
        tokens = [t for t in tokens if t != "total"] + ["total"]
    if kind == "gauge" and unit == "1":
        tokens = [t for t in tokens if t != "ratio"] + ["ratio"]
    return "_".join(tokens)
