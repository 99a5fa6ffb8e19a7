"""Static checks of PromQL against the metric catalogue, shared by the dashboard and rule tests.

A query that names a series the exporter never writes returns nothing, and an
empty panel or a silent alert looks exactly like a healthy system. These checks
parse each expression (``promql-parser``, a test dependency, imported here only)
and report every selector that does not match the catalogue, and every ratio
taken of raw counter values (lifetime averages that hide what happens now).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import promql_parser as pp

from kvmetrics.metrics import catalogue

#: Labels Prometheus attaches to every scraped series.
TARGET_LABELS = frozenset({"job", "instance"})
#: Functions after which a counter's value is a rate over a window, not a lifetime total.
RANGE_FUNCTIONS = frozenset({"rate", "irate", "increase", "resets"})

_FAMILY: dict[str, catalogue.MetricSpec] = {
    name: spec for spec in catalogue.ALL_METRICS for name in spec.series_names()
}


@dataclass(frozen=True)
class Selector:
    """One vector selector of an expression, with what encloses it."""

    name: str | None
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value); op as PromQL spells it
    under_range_function: bool
    under_division: bool


_OPS = {"MatchOp.Equal": "=", "MatchOp.NotEqual": "!=", "MatchOp.Re": "=~", "MatchOp.NotRe": "!~"}


def selectors(expr: str) -> list[Selector]:
    """Every vector selector in ``expr`` (plain PromQL), in source order."""
    tree = pp.parse(expr)
    stack: list[object] = []
    found: list[Selector] = []

    def pre(node: object) -> None:
        if isinstance(node, pp.VectorSelector):
            found.append(
                Selector(
                    name=node.name,
                    matchers=tuple(
                        (m.name, _OPS[str(m.op)], m.value) for m in node.matchers.matchers
                    ),
                    under_range_function=any(
                        isinstance(n, pp.Call) and n.func.name in RANGE_FUNCTIONS for n in stack
                    ),
                    under_division=any(
                        isinstance(n, pp.BinaryExpr) and str(n.op) == "/" for n in stack
                    ),
                )
            )
        stack.append(node)

    def post(node: object) -> None:
        stack.pop()

    pp.walk(tree, pre, post)
    return found


def _is_counter_series(name: str) -> bool:
    family = _FAMILY.get(name)
    if family is None:
        return False
    return family.kind == "counter" or (family.kind == "histogram" and name != family.name)


def problems(expr: str, extra_names: Iterable[str] = ()) -> list[str]:
    """What is wrong with ``expr``; empty when every name and label is in the catalogue.

    ``extra_names`` are series that exist without being exported by kvmetrics:
    recording rules defined beside the expression, or Prometheus' own ``up``.
    """
    extra = frozenset(extra_names)
    found: list[str] = []
    for sel in selectors(expr):
        if sel.name is None:
            found.append("selector without a metric name")
            continue
        if sel.name in extra:
            continue
        family = _FAMILY.get(sel.name)
        if family is None:
            found.append(f"{sel.name}: not in the kvmetrics catalogue")
            continue
        allowed_labels = set(family.label_names) | TARGET_LABELS
        if family.kind == "histogram":
            allowed_labels.add("le")
        for label, op, value in sel.matchers:
            if label not in allowed_labels:
                found.append(f"{sel.name}: no label {label!r}")
            elif op == "=" and value not in family.labels.get(label, (value,)):
                found.append(f"{sel.name}: {label} never takes the value {value!r}")
        if _is_counter_series(sel.name) and sel.under_division and not sel.under_range_function:
            found.append(f"{sel.name}: ratio of a lifetime counter (use rate or increase)")
    return found
