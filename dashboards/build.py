"""Write (or check) the generated dashboard JSON committed beside this module.

The JSON is generated, never edited by hand: Grafana provisioning, the
Kubernetes ConfigMap and the tests all read the committed file, and ``--check``
(run in CI) fails when it no longer matches the builder code. Output is
byte-for-byte deterministic: keys sorted, fixed indent, trailing newline.

Usage: ``python -m dashboards.build [--check]``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.cog.encoder import JSONEncoder

from dashboards import kv_cache_recovery

HERE = Path(__file__).resolve().parent

#: File name -> builder module. One entry per dashboard.
DASHBOARDS = {"kv-cache-recovery.json": kv_cache_recovery}


def render(module: Any = kv_cache_recovery) -> str:
    """The dashboard's JSON text exactly as committed."""
    board = json.loads(json.dumps(module.build().build(), cls=JSONEncoder))
    for panel in board.get("panels", []):
        # The SDK writes `"id": 0` on every row, i.e. duplicate ids; without an id
        # Grafana assigns unique ones, as it does for the other panels.
        if panel.get("type") == "row":
            panel.pop("id", None)
    return json.dumps(board, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def dashboard_dict(module: Any = kv_cache_recovery) -> dict[str, Any]:
    """The generated dashboard as plain JSON data (what Grafana receives)."""
    return json.loads(render(module))


def all_targets() -> list[tuple[str, str, str]]:
    """(panel title, legend format, PromQL expr) of every target of every dashboard,
    in panel order, built afresh from the builder modules.

    Exprs still hold Grafana variables: pass them through
    :func:`dashboards.queries.substitute_grafana_vars` before running them.
    """
    return [(panel["title"], target.get("legendFormat", ""), target["expr"])
            for module in DASHBOARDS.values()
            for panel in dashboard_dict(module).get("panels", [])
            for target in panel.get("targets", [])]


def all_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL expr) for every target of every dashboard, in panel order."""
    return [(title, expr) for title, _, expr in all_targets()]


_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$", re.DOTALL)


def variable_queries() -> list[tuple[str, str]]:
    """(variable name, PromQL expr) for every query variable, as runnable PromQL.

    Grafana's ``label_values(selector, label)`` is not PromQL; the equivalent
    ``count by (label) (selector)`` returns one series per value, so a live check
    can tell an empty variable (which would empty every panel) from a working one.
    """
    queries: list[tuple[str, str]] = []
    for module in DASHBOARDS.values():
        for variable in dashboard_dict(module).get("templating", {}).get("list", []):
            if variable.get("type") != "query":
                continue
            match = _LABEL_VALUES.match(variable["query"])
            if match is None:
                raise ValueError(f"variable {variable['name']}: not a label_values() query")
            expr = f"count by ({match['label']}) ({match['selector']})"
            queries.append((variable["name"], expr))
    return queries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true",
        help="exit 1 if a committed JSON file differs from what the builders produce",
    )
    args = parser.parse_args(argv)
    stale: list[str] = []
    for file_name, module in DASHBOARDS.items():
        path = HERE / file_name
        text = render(module)
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(file_name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(HERE.parent)}")
    if stale:
        print(
            f"out of date: {', '.join(stale)}; run `python -m dashboards.build`",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
