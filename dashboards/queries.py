"""PromQL building blocks for the dashboards, and Grafana-variable substitution.

Every metric name comes from :mod:`kvmetrics.metrics.catalogue`: a dashboard that
queries a series the exporter never writes shows an empty panel instead of an
error, so the names are never spelled by hand here. Label values on bounded labels
are checked against the catalogue for the same reason (``outcome="fail"`` instead
of ``outcome="failed"`` would silently match nothing).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from kvmetrics.metrics import catalogue

#: Matchers applied to every kvmetrics selector, so that one dashboard serves a
#: fleet: several models, replicas (``instance``; every replica's engine is "0")
#: and data-parallel engines sharing one Prometheus.
FILTER = 'model_name=~"$model_name", instance=~"$instance", engine=~"$engine"'

#: Matchers for vLLM's own series (``catalogue.VLLM_SERIES``). They share
#: ``model_name`` and ``engine`` with kvmetrics', not ``instance``: vLLM serves them
#: from its API server, another target than the EngineCore's kvmetrics endpoint. The
#: ``replica`` target label both get in deploy/prometheus/prometheus.yml pairs them.
VLLM_FILTER = 'model_name=~"$model_name", engine=~"$engine"'
_VLLM_NAMES = frozenset(spec.name for spec in catalogue.VLLM_SERIES)

#: Series Prometheus writes itself for every scrape target. They carry no
#: ``model_name``/``engine`` labels, so they are filtered by ``job`` instead (the
#: ``$job`` variable lists the jobs whose targets export kvmetrics).
TARGET_SERIES: tuple[str, ...] = ("up", "scrape_duration_seconds", "scrape_samples_scraped")
TARGET_FILTER = 'job=~"$job"'

#: Values used when a query is evaluated outside Grafana (tests, the live check).
#: ``.*`` selects every model and engine, as the dashboard's "All" option does.
GRAFANA_VARS: dict[str, str] = {
    "__rate_interval": "1m",
    "__interval": "1m",
    "__range": "1h",
    "model_name": ".*",
    "instance": ".*",
    "engine": ".*",
    "job": ".*",
    "datasource": "prometheus",
}

_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")

#: Series name -> the family that exposes it (histograms expose three names).
_FAMILY: dict[str, catalogue.MetricSpec] = {
    name: spec for spec in catalogue.ALL_METRICS for name in spec.series_names()
}


def substitute_grafana_vars(expr: str, values: Mapping[str, str] = GRAFANA_VARS) -> str:
    """Replace Grafana variables by ``values`` (default: :data:`GRAFANA_VARS`), which
    makes ``expr`` plain PromQL.

    Unknown variables raise, so that a typo such as ``$modelname`` fails a test
    instead of reaching Prometheus as a literal.
    """

    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        try:
            return values[name]
        except KeyError:
            raise ValueError(f"unknown Grafana variable ${name} in {expr!r}") from None

    return _VAR.sub(repl, expr)


def series(spec: catalogue.MetricSpec, suffix: str = "") -> str:
    """Name of one sample series of ``spec`` (``suffix`` picks a histogram's part)."""
    name = spec.name + suffix
    if name not in spec.series_names():
        raise KeyError(f"{name!r} is not a series of {spec.name!r}")
    return name


def sel(name: str, **labels: str) -> str:
    """Selector for a catalogue series with the dashboard filter and exact label values."""
    family = _FAMILY.get(name)
    if family is None:
        raise KeyError(f"{name!r} is not in the kvmetrics catalogue")
    for label, value in labels.items():
        if label not in family.label_names:
            raise KeyError(f"{family.name} has no label {label!r}")
        allowed = family.labels.get(label)
        if allowed is not None and value not in allowed:
            raise ValueError(f"{family.name}{{{label}}} never takes the value {value!r}")
    extra = "".join(f', {label}="{value}"' for label, value in labels.items())
    return f"{name}{{{FILTER}{extra}}}"


def target_sel(name: str) -> str:
    """Selector for a per-target series Prometheus writes (``up`` and friends)."""
    if name not in TARGET_SERIES:
        raise KeyError(f"{name!r} is not a per-target Prometheus series")
    return f"{name}{{{TARGET_FILTER}}}"


def _by(labels: Iterable[str]) -> str:
    labels = tuple(labels)
    return f" by ({', '.join(labels)})" if labels else ""


def sum_rate(name: str, by: Iterable[str] = (), **labels: str) -> str:
    """Per-second rate summed over the selection, over Grafana's safe rate window."""
    return f"sum{_by(by)} (rate({sel(name, **labels)}[$__rate_interval]))"


def ratio(numerator: str, denominator: str) -> str:
    """``numerator / denominator``, with no data (not 0, not NaN) where the denominator is 0.

    A ratio of nothing looked up is undefined: shown as 0 it would colour a panel red
    forever (the external hit ratio of a server without a connector). Every counter
    series exists from the exporter's start, so the numerator needs no fallback.
    """
    return f"{numerator}\n/\n({denominator} > 0)"


def quantile(q: float, spec: catalogue.MetricSpec, by: Iterable[str] = ()) -> str:
    """Quantile of a catalogue histogram over the rate window, aggregated by ``le``."""
    keep = ("le", *by)
    return f"histogram_quantile({q}, {sum_rate(series(spec, '_bucket'), by=keep)})"


def vllm_sum_rate(name: str, by: Iterable[str] = ()) -> str:
    """Per-second rate of one of vLLM's own series (the allow-list), summed."""
    if name not in _VLLM_NAMES:
        raise KeyError(f"{name!r} is not in catalogue.VLLM_SERIES")
    return f"sum{_by(by)} (rate({name}{{{VLLM_FILTER}}}[$__rate_interval]))"
