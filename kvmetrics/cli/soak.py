"""``kvmetrics soak``: many seeded random scenarios, in parallel or as one shard of many."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from contextlib import suppress
from typing import Any

from kvmetrics.cli.common import (
    EXIT_OUTPUT,
    Command,
    Interrupted,
    check_output_path,
    choice_list,
    fail,
    interrupt_exit_code,
    say,
    stderr_is_tty,
    write_output,
)
from kvmetrics.metrics import strict_json
from kvmetrics.metrics.text import escape_for_display

#: Failing scenarios listed in the text report (the JSON lists them all).
SHOWN_FAILURES = 20


#: Printed under the failing seeds of a campaign on vLLM's own recovery path: a
#: newcomer's first soak exits 1, and that is the finding, not a broken install.
EXPECTED_UNDER_VLLM_RECOVERY = (
    "\n(expected with --recovery vllm, the default: it runs vLLM's recovery path as it is, "
    "and these seeds hit its known defects, docs/vllm-defects.md; --recovery evict runs "
    "kvmetrics' fix)")

def _shard(text: str) -> Any:
    from kvmetrics.lab.soak import Shard, SoakReportError

    try:
        return Shard.parse(text)
    except SoakReportError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _jobs(text: str) -> int:
    if text == "auto":
        return os.cpu_count() or 1
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--jobs must be a positive integer or auto, got "
                                         f"{text!r}")
    return int(text)


def _scenarios(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _add(p: argparse.ArgumentParser) -> None:
    from kvmetrics.lab.config import VERIFY_MODES
    from kvmetrics.lab.engine.config import ACCOUNTINGS, RECOVERIES
    from kvmetrics.lab.engine_registry import engine_names

    p.add_argument("--scenarios", type=_scenarios, default=100, metavar="N",
                   help="scenarios in the whole campaign (default 100)")
    p.add_argument("--engines", type=choice_list(engine_names, "engine"),
                   default=["reference"], metavar="LIST",
                   help=f"comma-separated engines to run each scenario on "
                   f"({', '.join(engine_names())}; default reference)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first scenario")
    p.add_argument("--accounting", default="unified", choices=ACCOUNTINGS,
                   help="counter accounting of every scenario (historical: the old "
                   "negative increments, expected there)")
    p.add_argument("--verify", default="full", choices=VERIFY_MODES,
                   help="the data-plane verifier's mode in every scenario (off: no stale "
                   "reads can be found, much faster)")
    p.add_argument("--recovery", default="vllm", choices=RECOVERIES,
                   help="vllm (default: vLLM 0.33's recovery path) or evict (the fix), "
                   "on every engine")
    p.add_argument("--jobs", "-j", type=_jobs, default=1, metavar="N",
                   help="worker processes (default 1; auto: one per CPU); the report is the "
                   "same for any N")
    p.add_argument("--shard", type=_shard, metavar="I/N",
                   help="run only shard I (0-based) of N: a contiguous slice of the seed "
                   "range; `kvmetrics soak-merge` combines the shards' --json reports")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--output", metavar="PATH", help="also write the JSON report to PATH")
    p.add_argument("--explain", type=int, metavar="SEED",
                   help="run only scenario SEED (on each of --engines) as `kvmetrics run` "
                   "would: print its command line, summary and findings explained, and "
                   "write its HTML report, ENGINE-SEED.html, into --report-dir (by default "
                   "the current directory)")
    p.add_argument("--report-dir", metavar="DIR",
                   help="where HTML reports go (ENGINE-SEED.html): the --explain one's "
                   "(default: the current directory), or one per failing scenario of a "
                   f"campaign (the first {SHOWN_FAILURES}; a campaign writes none without "
                   "this option)")


def print_report(data: dict[str, Any], as_json: bool) -> None:
    """The report as JSON, or as rows of text with every value escaped for a terminal
    (an engine name or error read from a shard may hold ESC sequences)."""
    if as_json:
        print(strict_json.dumps(data, indent=2))
        return
    rows = {k: v for k, v in data.items()
            if k not in ("version", "failures", "failing_seeds", "digest")}
    rows["campaign"] = ", ".join(f"{k}={','.join(v) if isinstance(v, list) else v}"
                                 for k, v in data["campaign"].items())
    rows["seeds"] = f"{data['seeds'][0]}..{data['seeds'][1] - 1}"
    failing = data["failing_seeds"]
    more = len(failing) - SHOWN_FAILURES
    rows["failing_seeds"] = " ".join(failing[:SHOWN_FAILURES]) + (
        f" (+{more} more; --json lists all)" if more > 0 else "")
    for key, value in rows.items():
        print(f"{key:<27} {'-' if value is None else escape_for_display(str(value))}")


def exit_code(report: Any) -> int:
    """1 when a scenario crashed or found something the campaign's accounting forbids."""
    return 1 if report.failed else 0


def _scenario(seed: int, engine: str, args: argparse.Namespace) -> Any:
    from kvmetrics.lab.soak import scenario_config

    return scenario_config(seed, engine, args.accounting, args.verify, args.recovery)


def replay_lines(failures: list[Any], args: argparse.Namespace) -> list[str]:
    """One ``kvmetrics run`` line per failing scenario (the first SHOWN_FAILURES)."""
    from kvmetrics.lab.replay import run_command

    return [f"  {run_command(_scenario(o.seed, o.engine, args))}"
            for o in failures[:SHOWN_FAILURES]]


def report_path(report_dir: str | None, engine: str, seed: int) -> str:
    """Where a scenario's HTML report goes: ENGINE-SEED.html in ``report_dir``, or in the
    current directory (named as a person would type it, without ``./``)."""
    name = f"{engine}-{seed}.html"
    return name if report_dir is None else os.path.join(report_dir, name)


def _explain(seeds: list[tuple[int, str]], args: argparse.Namespace, *, show: bool,
             reports: bool) -> tuple[int, bool]:
    """Run each (seed, engine) scenario as ``kvmetrics run`` would, print what it found
    (``show``) and write its report (``reports``, see :func:`_reports`); returns the stale
    reads found in all, and whether every report that was due got written."""
    from kvmetrics.lab.replay import run_command
    from kvmetrics.lab.report import render_report
    from kvmetrics.lab.runner import run_lab
    from kvmetrics.lab.summary import render_table

    stale, written = 0, True
    for seed, engine in seeds:
        cfg = _scenario(seed, engine, args)
        try:
            result = run_lab(cfg)
        except Exception as e:  # noqa: BLE001 - a crashing scenario is a finding, shown
            print(f"kvmetrics: scenario {engine}:{seed} "
                  f"({run_command(cfg)}): {type(e).__name__}: {e}", file=sys.stderr)
            stale += 1
            continue
        stale += result.summary["verification"]["failed_blocks"]
        if show:
            with suppress(OSError):  # a hung-up terminal must not stop the report
                print(f"scenario {engine}:{seed}: {run_command(cfg)}")
                print(render_table(result.document(), rich=False) + "\n", flush=True)
        if reports:
            path = report_path(args.report_dir, engine, seed)
            if write_output(path, render_report(result.document())):
                say(f"report of {engine}:{seed} written to {path}")
            else:
                written = False
    return stale, written


def _reports(args: argparse.Namespace) -> tuple[bool, str | None]:
    """Whether HTML reports are written, and the one-line problem that stops the command
    before any work (or None). A campaign writes them only into a --report-dir; --explain
    always writes its scenario's, into the current directory unless --report-dir names
    another. Without matplotlib a --report-dir given by name is refused, while --explain's
    default report is skipped with one line and the explanation still printed."""
    from kvmetrics.lab.report import ReportUnavailable, require_report_support

    if args.explain is None and args.report_dir is None:
        return False, None
    if args.report_dir is not None and not os.path.isdir(args.report_dir):
        return False, f"--report-dir: {args.report_dir} is not a directory"
    try:
        require_report_support()
    except ReportUnavailable as e:
        if args.report_dir is not None:
            return False, str(e)
        say(f"no HTML report will be written: {e}")
        return False, None
    if args.explain is not None:
        for engine in args.engines:
            path = report_path(args.report_dir, engine, args.explain)
            problem = check_output_path(path)
            if problem:
                return False, f"the report {path}: {problem} (--report-dir DIR writes it " \
                    "elsewhere)"
    return True, None


def _check_outputs(args: argparse.Namespace) -> str | None:
    problem = check_output_path(args.output)
    if problem:
        return f"--output: {problem}"
    if args.explain is not None and args.explain < 0:
        return f"--explain: a seed is >= 0, got {args.explain}"
    if args.explain is not None and (args.shard is not None or args.output is not None):
        return "--explain runs one scenario: --shard and --output do not apply"
    return None


def _run(args: argparse.Namespace) -> int:
    from kvmetrics.lab.progress import Progress
    from kvmetrics.lab.soak import Campaign, Shard, soak

    problem = _check_outputs(args)
    reports = False
    if problem is None:
        reports, problem = _reports(args)
    if problem:
        return fail(problem)
    if args.explain is not None:
        stale, written = _explain([(args.explain, e) for e in args.engines], args,
                                  show=True, reports=reports)
        if not written:
            return EXIT_OUTPUT
        return 1 if stale else 0
    shard = args.shard or Shard(0, 1)
    engines = args.engines
    campaign = Campaign(args.scenarios, args.seed, tuple(engines), args.accounting,
                        args.verify, args.recovery)
    todo = len(shard.seeds(campaign))
    if todo == 0:
        return fail(f"shard {shard} of {args.scenarios} scenarios is empty "
                    f"(use at most {args.scenarios} shards)")
    # Findings are tallied, not logged (unless -v); the levels are restored afterwards,
    # so that a caller of main() keeps its logging as it was.
    quiet = {} if args.verbose else {name: logging.getLogger(name).level
                                     for name in ("kvmetrics", "vllm")}
    bar = Progress(todo, enabled=stderr_is_tty(), unit="scenarios")
    try:
        for name in quiet:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        report = soak(args.scenarios, engines, args.seed, args.accounting, args.verify,
                      recovery=args.recovery, jobs=args.jobs, shard=args.shard,
                      on_progress=lambda r: bar.update(r.scenarios // len(engines)),
                      on_workers=lambda pids: say(
                          f"running {todo * len(engines)} scenarios in {len(pids)} worker "
                          f"processes (pids {' '.join(map(str, pids))})"))
    finally:
        bar.close()
        for name, level in quiet.items():
            logging.getLogger(name).setLevel(level)
    data = report.as_dict()
    # First, so that a failed write below loses no report; a terminal that hung up
    # (EIO) must not stop the write either.
    with suppress(OSError):
        print_report(data, args.json)
    written = True
    if args.output:
        written = write_output(args.output, strict_json.dumps(data, indent=2) + "\n")
        if written:
            say(f"report written to {args.output}")
    if report.interrupted:
        say(f"interrupted ({data['interrupted']}) after {report.scenarios} scenario(s); "
            "the report covers those")
        return interrupt_exit_code(Interrupted(report.interrupted))
    if report.failures:
        # JSON on stdout stays the whole output; the replay lines go to stderr then.
        stream = sys.stderr if args.json else sys.stdout
        print("\nreplay a failing scenario (full summary, findings explained; add "
              "--report FILE.html), or `kvmetrics soak --explain SEED`:", file=stream)
        print("\n".join(replay_lines(report.failures, args)), file=stream)
        if args.recovery == "vllm":
            print(EXPECTED_UNDER_VLLM_RECOVERY, file=stream)
        if reports:
            _, all_written = _explain([(o.seed, o.engine)
                                       for o in report.failures[:SHOWN_FAILURES]],
                                      args, show=False, reports=True)
            written = written and all_written
    return exit_code(report) if written else EXIT_OUTPUT


COMMAND = Command(
    "soak", "run many seeded random scenarios and count violations", _add, _run,
    description="Run seeded random scenarios (workload, cache size, faults, policy, aborts) "
    "and count invariant violations, guard rejections, verification failures and crashes. "
    "Exits 1 when a scenario crashed or the verifier found stale KV (in every accounting "
    "mode), or, under the unified accounting, an invariant broke or the guard rejected an "
    "increment.",
    examples=(
        "kvmetrics soak --scenarios 1000 --jobs auto",
        "kvmetrics soak --explain 43           # explain one failing scenario: reference-43.html",
        "kvmetrics soak --scenarios 20 --report-dir reports/  # a report per failing seed",
        "kvmetrics soak --scenarios 200 --engines reference,vllm --recovery evict",
        "kvmetrics soak --scenarios 10000 --shard 3/8 --json > shard-3.json",
        "kvmetrics soak-merge shard-*.json",
    ))
