"""``kvmetrics report``: the HTML report of a run saved with ``kvmetrics run --output``."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmetrics.cli.common import (
    EXIT_OUTPUT,
    Command,
    check_output_path,
    clashing_paths,
    fail,
    read_json_file,
    write_output,
)
from kvmetrics.metrics.text import escape_for_display


def _add(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN.json", help="a run saved by `kvmetrics run --output`")
    p.add_argument("-o", "--output", metavar="FILE.html",
                   help="where to write the report (default: RUN.json with .html)")


def _run(args: argparse.Namespace) -> int:
    from kvmetrics.lab.report import ReportInputError, ReportUnavailable, render_report

    target = args.output or str(Path(args.run).with_suffix(".html"))
    problem = check_output_path(target) or clashing_paths({"--output": target},
                                                          {"RUN.json": args.run})
    if problem:
        return fail(f"--output: {problem}")
    document, problem = read_json_file(args.run)
    if problem:
        return fail(problem)
    try:
        page = render_report(document)
    except ReportInputError as e:
        return fail(f"{args.run}: {e}")
    except ReportUnavailable as e:
        return fail(str(e))
    if not write_output(target, page):
        return EXIT_OUTPUT
    print(escape_for_display(target))
    return 0


COMMAND = Command(
    "report", "write the HTML report of a saved run", _add, _run,
    description="Chart a run saved with `kvmetrics run --output RUN.json` as one "
    "self-contained HTML file (opens offline: no script, no network fetch).",
    examples=(
        "kvmetrics run --output run.json && kvmetrics report run.json   # writes run.html",
        "kvmetrics report run.json -o /tmp/report.html",
        "kvmetrics run --report run.html     # the same in one go",
    ))
