"""Generate the Kubernetes PrometheusRule and dashboard ConfigMap from their sources.

deploy/prometheus/rules.yml and dashboards/*.json are the single sources; the
manifests here are derived so that Kubernetes users get exactly the rules that
promtool tests and the dashboard that the builder produces. tests/test_deploy.py
fails when a committed manifest is out of date.

Usage: ``python deploy/kubernetes/generate.py [--check]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
DASHBOARDS = ROOT / "dashboards"

PROMETHEUS_RULE = HERE / "prometheusrule.yaml"
DASHBOARD_CONFIGMAP = HERE / "dashboard-configmap.yaml"

_LABELS = {"app.kubernetes.io/name": "kvmetrics", "app.kubernetes.io/part-of": "kvmetrics"}


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (PromQL, dashboard JSON) as literal blocks, for review."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _dump(header: str, document: dict[str, Any]) -> str:
    body = yaml.dump(
        document, Dumper=_Dumper, sort_keys=False, width=4096, allow_unicode=True
    )
    return f"{header}\n{body}"


def _header(source: str) -> str:
    return (
        f"# GENERATED from {source} by deploy/kubernetes/generate.py; do not edit.\n"
        "# Regenerate: python deploy/kubernetes/generate.py"
    )


def render_prometheus_rule() -> str:
    """PrometheusRule whose spec.groups is rules.yml's groups, unchanged."""
    rules = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    document = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "kvmetrics",
            # Add the label your Prometheus' ruleSelector wants (e.g. release: <name>).
            "labels": dict(_LABELS),
        },
        "spec": {"groups": rules["groups"]},
    }
    return _dump(_header("deploy/prometheus/rules.yml"), document)


def render_dashboard_configmap() -> str:
    """ConfigMap holding every generated dashboard, for the Grafana dashboard sidecar."""
    data: dict[str, str] = {}
    for path in sorted(DASHBOARDS.glob("*.json")):
        text = path.read_text(encoding="utf-8")
        json.loads(text)  # a broken file must fail here, not in Grafana
        data[path.name] = text
    document = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "kvmetrics-dashboards",
            # grafana_dashboard is the label Grafana's dashboard sidecar looks for.
            "labels": {**_LABELS, "grafana_dashboard": "1"},
        },
        "data": data,
    }
    return _dump(_header("dashboards/*.json"), document)


OUTPUTS = {PROMETHEUS_RULE: render_prometheus_rule, DASHBOARD_CONFIGMAP: render_dashboard_configmap}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a committed manifest is out of date"
    )
    args = parser.parse_args(argv)
    stale: list[str] = []
    for path, render in OUTPUTS.items():
        text = render()
        if path.exists() and path.read_text(encoding="utf-8") == text:
            continue
        if args.check:
            stale.append(path.name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run {Path(__file__).name}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
