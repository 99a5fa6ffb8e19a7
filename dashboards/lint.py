"""Static checks of PromQL against the metric catalogue, shared by the dashboard and rule tests.

A query that names a series the exporter never writes returns nothing, and an
empty panel or a silent alert looks exactly like a healthy system. These checks
parse each expression (``promql-parser``, a test dependency, imported here only)
and report:

- selectors of series the catalogue does not define, a counter without its
  ``_total`` suffix, labels a family does not have, and label values outside
  the catalogue's sets;
- ``by``/``without``/``on``/``ignoring`` lists naming a label no series carries;
- ``rate``/``increase``/``irate`` over anything but a counter (a gauge's "rate"
  is noise, a recording rule's output is a gauge);
- ``histogram_quantile`` over an aggregation that drops ``le``;
- ratios of raw counter values (lifetime averages that hide what happens now).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import promql_parser as pp

from kvmetrics.metrics import catalogue

#: Labels Prometheus (or a prometheus-operator PodMonitor) attaches to scraped series;
#: ``replica`` is the target label deploy/prometheus/prometheus.yml gives both
#: endpoints of one vLLM replica (kvmetrics' and vLLM's own) so panels can pair them.
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "replica"})
#: Functions after which a counter's value is a rate over a window, not a lifetime total.
RANGE_FUNCTIONS = frozenset({"rate", "irate", "increase", "resets"})
#: Functions whose argument must be a counter.
COUNTER_FUNCTIONS = frozenset({"rate", "irate", "increase"})

#: kvmetrics' series, and vLLM's own that the dashboards show beside them
#: (``catalogue.VLLM_SERIES``, the allow-list of vLLM names).
_FAMILY: dict[str, catalogue.MetricSpec] = {
    name: spec for spec in (*catalogue.ALL_METRICS, *catalogue.VLLM_SERIES)
    for name in spec.series_names()
}
#: Every label a kvmetrics series (or a scrape) can carry.
KNOWN_LABELS = frozenset(
    {label for spec in catalogue.ALL_METRICS for label in spec.label_names}
    | TARGET_LABELS | {"le"}
)


@dataclass(frozen=True)
class Selector:
    """One vector selector of an expression, with what encloses it."""

    name: str | None
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value); op as PromQL spells it
    under_range_function: bool
    under_division: bool
    #: The function the selector is the direct argument of (``rate`` in ``rate(x[5m])``).
    function: str | None = None


_OPS = {"MatchOp.Equal": "=", "MatchOp.NotEqual": "!=", "MatchOp.Re": "=~", "MatchOp.NotRe": "!~"}


def _walk(expr: str) -> tuple[list[Selector], list[object]]:
    """Every vector selector in ``expr`` (plain PromQL) in source order, and every node."""
    tree = pp.parse(expr)
    stack: list[object] = []
    found: list[Selector] = []
    nodes: list[object] = []

    def pre(node: object) -> None:
        nodes.append(node)
        if isinstance(node, pp.VectorSelector):
            parent = stack[-2] if len(stack) >= 2 and isinstance(stack[-1], pp.MatrixSelector) \
                else (stack[-1] if stack else None)
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
                    function=parent.func.name if isinstance(parent, pp.Call) else None,
                )
            )
        stack.append(node)

    def post(node: object) -> None:
        stack.pop()

    pp.walk(tree, pre, post)
    return found, nodes


def selectors(expr: str) -> list[Selector]:
    """Every vector selector in ``expr`` (plain PromQL), in source order."""
    return _walk(expr)[0]


def _is_counter_series(name: str) -> bool:
    family = _FAMILY.get(name)
    if family is None:
        return False
    return family.kind == "counter" or (family.kind == "histogram" and name != family.name)


def _keeps_le(node: object) -> bool:
    """Whether the buckets handed to ``histogram_quantile`` still carry ``le``."""
    while isinstance(node, pp.ParenExpr):
        node = node.expr
    if isinstance(node, pp.AggregateExpr):
        modifier = node.modifier
        if modifier is None:
            return False  # sum(x) keeps no label at all
        labels = set(modifier.labels)
        return "le" in labels if str(modifier.type).endswith("By") else "le" not in labels
    return True


def _grouping_labels(node: object) -> list[str]:
    """Labels named in an aggregation's by/without or a binary operation's on/ignoring."""
    if isinstance(node, pp.AggregateExpr) and node.modifier is not None:
        return list(node.modifier.labels)
    if isinstance(node, pp.BinaryExpr) and node.modifier is not None:
        matching = node.modifier.matching
        labels = list(matching.labels) if matching is not None else []
        return labels + list(node.modifier.group_labels or ())
    return []


def problems(expr: str, extra_names: Iterable[str] = ()) -> list[str]:
    """What is wrong with ``expr``; empty when every name and label is in the catalogue.

    ``extra_names`` are series that exist without being exported by kvmetrics:
    recording rules defined beside the expression, or Prometheus' own ``up``. They
    are not counters, so they may not be the argument of ``rate`` or ``increase``.
    """
    extra = frozenset(extra_names)
    found: list[str] = []
    sels, nodes = _walk(expr)
    for sel in sels:
        if sel.name is None:
            found.append("selector without a metric name")
            continue
        if sel.function in COUNTER_FUNCTIONS and not _is_counter_series(sel.name):
            found.append(f"{sel.name}: {sel.function}() of something that is not a counter")
        if sel.name in extra:
            continue
        family = _FAMILY.get(sel.name)
        if family is None:
            if _FAMILY.get(sel.name + "_total") is not None:
                found.append(f"{sel.name}: a counter needs its _total suffix")
            else:
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
    for node in nodes:
        for label in _grouping_labels(node):
            if label not in KNOWN_LABELS:
                found.append(f"grouping by {label!r}: no kvmetrics series has that label")
        if isinstance(node, pp.Call) and node.func.name == "histogram_quantile" \
                and len(node.args) == 2 and not _keeps_le(node.args[1]):
            found.append("histogram_quantile over an aggregation that drops 'le'")
    return found
