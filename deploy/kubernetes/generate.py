"""Generate the Kubernetes PrometheusRule and dashboard ConfigMap from their sources.

deploy/prometheus/rules.yml and dashboards/*.json are the single sources; the
manifests here are derived so that Kubernetes users get exactly the rules that
promtool tests and the dashboard that the builder produces. tests/test_deploy.py
fails when a committed manifest is out of date.

Usage: ``python deploy/kubernetes/generate.py [--check]``, or, for a deployment,
``python deploy/kubernetes/generate.py --runbook-base URL --out-dir DIR``: the
manifests and rules.yml with every runbook link (each alert's ``runbook_url``, the
dashboard's "Runbook" link) made absolute under URL, where your on-call browses this
repository. As shipped, the links are paths in the repository (``docs/runbook.md#...``).
"""

from __future__ import annotations

import argparse
import json
import re
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

#: The runbook as a path in this repository: every runbook link as shipped starts so.
RUNBOOK_PATH = "docs/runbook.md"
#: Where a link to the runbook stands: an alert's runbook_url (quoted in rules.yml, plain
#: in the generated manifest) and the dashboard's link ("url" in its JSON).
_RUNBOOK_LINK = re.compile(r'(runbook_url: "?|"url": ")(?=' + re.escape(RUNBOOK_PATH) + r'["#])')

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


def with_runbook_base(text: str, base: str) -> str:
    """``text`` with every runbook link made ``base/docs/runbook.md...`` (``base`` checked:
    an absolute http(s) or file URL, nothing that could break out of a YAML string)."""
    base = base.rstrip("/")
    if not base.startswith(("https://", "http://", "file:///")) or any(
            c in base for c in " \t\n\"'\\{}$#?"):
        raise ValueError(f"--runbook-base must be an http(s):// or file:/// URL without "
                         f"quotes, spaces, braces, '$', '#' or '?', got {base!r}")
    return _RUNBOOK_LINK.sub(lambda m: f"{m.group(1)}{base}/", text)


def write_deployment(base: str, out_dir: Path) -> list[Path]:
    """The manifests and rules.yml with the runbook base filled in, into ``out_dir``."""
    written = []
    sources = {PROMETHEUS_RULE.name: render_prometheus_rule,
               DASHBOARD_CONFIGMAP.name: render_dashboard_configmap,
               RULES.name: lambda: RULES.read_text(encoding="utf-8")}
    for name, render in sources.items():
        path = out_dir / name
        path.write_text(with_runbook_base(render(), base), encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a committed manifest is out of date"
    )
    parser.add_argument("--runbook-base", metavar="URL",
                        help="where your on-call browses this repository (URL/docs/"
                        "runbook.md is the runbook); with --out-dir")
    parser.add_argument("--out-dir", metavar="DIR",
                        help="write prometheusrule.yaml, dashboard-configmap.yaml and "
                        "rules.yml with --runbook-base filled in to DIR")
    args = parser.parse_args(argv)
    if bool(args.runbook_base) != bool(args.out_dir):
        parser.error("--runbook-base and --out-dir go together")
    if args.runbook_base:
        if not Path(args.out_dir).is_dir():
            parser.error(f"--out-dir {args.out_dir} is not a directory")
        try:
            for path in write_deployment(args.runbook_base, Path(args.out_dir)):
                print(f"wrote {path}")
        except ValueError as e:
            parser.error(str(e))
        return 0
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
