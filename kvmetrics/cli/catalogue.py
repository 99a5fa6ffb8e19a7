"""``kvmetrics catalogue``: every exported metric, as a table or as JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvmetrics.cli.common import Command


def _add(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print name, type, unit, labels with their values, and help as "
                        "a JSON list")


def describe() -> list[dict[str, Any]]:
    """The catalogue as plain data: what a tool generating queries or docs needs."""
    from kvmetrics.metrics.catalogue import ALL_METRICS, COMMON_LABELS

    out = []
    for spec in ALL_METRICS:
        # None: the label's values are open (model names, metric names, versions).
        labels: dict[str, list[str] | None] = {name: None for name in COMMON_LABELS}
        labels.update({name: list(values) for name, values in spec.labels.items()})
        labels.update({name: None for name in spec.open_labels})
        out.append({"name": spec.name, "type": spec.kind, "unit": spec.unit or None,
                    "labels": labels, "help": spec.help})
    return out


def _run(args: argparse.Namespace) -> int:
    entries = describe()
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    for entry in entries:
        labels = ",".join(entry["labels"])
        print(f"{entry['name']:<48} {entry['type']:<9} {{{labels}}}")
    return 0


COMMAND = Command("catalogue", "list every exported metric", _add, _run,
                  examples=("kvmetrics catalogue",
                            "kvmetrics catalogue --json | jq '.[] | select(.type == \"counter\")"
                            " | .name'"))
