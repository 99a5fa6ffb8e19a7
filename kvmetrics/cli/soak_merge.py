"""``kvmetrics soak-merge``: the shards' JSON reports as the report of the whole campaign."""

from __future__ import annotations

import argparse
from contextlib import suppress

from kvmetrics.cli.common import (
    EXIT_OUTPUT,
    Command,
    check_output_path,
    clashing_paths,
    fail,
    read_json_file,
    write_output,
)
from kvmetrics.cli.soak import exit_code, print_report
from kvmetrics.metrics import strict_json


def _add(p: argparse.ArgumentParser) -> None:
    p.add_argument("reports", nargs="+", metavar="FILE",
                   help="JSON reports of `kvmetrics soak --shard I/N --json`, one per shard")
    p.add_argument("--json", action="store_true", help="print the merged report as JSON")
    p.add_argument("--output", metavar="PATH", help="also write the merged report to PATH")


def _run(args: argparse.Namespace) -> int:
    from kvmetrics.lab.soak import SoakReport, SoakReportError, merge_reports

    problem = check_output_path(args.output)
    if problem:
        return fail(f"--output: {problem}")
    clash = clashing_paths({"--output": args.output},
                           {f"report {i + 1}": path for i, path in enumerate(args.reports)})
    if clash:
        return fail(clash)
    reports = []
    for path in args.reports:
        data, problem = read_json_file(path)
        if problem:
            return fail(problem)
        try:
            reports.append(SoakReport.from_dict(data))
        except SoakReportError as e:
            return fail(f"{path}: {e}")
    try:
        merged = merge_reports(reports)
    except SoakReportError as e:
        return fail(str(e))
    data = merged.as_dict()
    # First, so that a failed write below loses no report; a terminal that hung up
    # (EIO) must not stop the write either.
    with suppress(OSError):
        print_report(data, args.json)
    if args.output and not write_output(args.output, strict_json.dumps(data, indent=2) + "\n"):
        return EXIT_OUTPUT
    return exit_code(merged)


COMMAND = Command(
    "soak-merge", "merge the shard reports of one soak campaign", _add, _run,
    description="Combine the JSON reports of every shard of one `kvmetrics soak` campaign "
    "into the report of the whole campaign (equal to a single run's, but for wall time, "
    "which is summed). Refuses reports of different campaigns, a missing shard or one given "
    "twice. Exits like `kvmetrics soak`.",
    examples=(
        "for i in 0 1 2 3; do kvmetrics soak --scenarios 400 --shard $i/4 --json "
        "> shard-$i.json; done",
        "kvmetrics soak-merge shard-*.json --json",
    ))
