"""``kvmetrics workloads``: the synthetic workloads, one line each."""

from __future__ import annotations

import argparse

from kvmetrics.cli.common import Command


def _add(parser: argparse.ArgumentParser) -> None:
    pass


def _run(args: argparse.Namespace) -> int:
    from kvmetrics.lab.synthetic import DESCRIPTIONS

    width = max(map(len, DESCRIPTIONS))
    for name, text in DESCRIPTIONS.items():
        print(f"{name:<{width}}  {text}")
    return 0


COMMAND = Command("workloads", "list the synthetic workloads", _add, _run,
                  examples=("kvmetrics workloads",
                            "kvmetrics run --workload rag     # run one of them"))
