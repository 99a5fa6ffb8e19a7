"""``kvmetrics vllm-check``: run the defect canaries on the installed vLLM.

Operators run it before an upgrade, vLLM developers on a fix: each known
recovery-path defect is replayed as a minimal scenario on vLLM's own scheduler
(docs/vllm-defects.md). The table says present / absent / unknown (a canary that
cannot run on this vLLM's internals says why); ``--json`` prints
``{"vllm_version": ..., "counts": {"present", "absent", "unknown"}, "defects":
[{"id", "present", "summary", "upstream"}]}`` (plus each canary's ``detail``).
vLLM is imported only when the command runs.

An unknown is never counted as absent: a canary that could not run says nothing
about its defect, so the headline names the unknowns and the exit code is
:data:`EXIT_UNKNOWN` when there is any (0 when every canary answered, present or
absent; 2 for bad arguments or no vLLM). A script that reads only the exit code
therefore never takes "could not check" for "fixed".
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from kvmetrics.cli.common import Command, fail
from kvmetrics.lab.config import VLLM_INSTALL_HINT

#: Every canary ran, but at least one could not tell (``present: null``).
EXIT_UNKNOWN = 3


def _add(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--only", metavar="ID", action="append",
                   help="run only this defect's canary (repeatable)")
    p.add_argument("--repro", metavar="ID",
                   help="print this defect's reproduction, the test the patch series of "
                   "docs/vllm-patches/ adds to vLLM's tests/v1/kv_connector/unit/, and exit")


def reproduction(defect_id: str) -> str:
    """The defect's reproduction, as the patch series of docs/vllm-patches/ adds it to
    vLLM's own test file, with a header that says where it goes and how to run it."""
    from kvmetrics.lab.vllm.series import FIXES
    from kvmetrics.lab.vllm.series import reproduction as added_test

    fix = FIXES[defect_id]
    path = fix.reproduction.split("::")[0]
    return (f"# {defect_id}: added to vLLM's {path} by\n"
            f"# docs/vllm-patches/{fix.patch} (kvmetrics). It uses that file's imports\n"
            f"# and fixtures; on vLLM 0.34.0 it fails, with the series applied it passes:\n"
            f"#   pytest -q {fix.reproduction}\n\n"
            + added_test(defect_id))


def _run(args: argparse.Namespace) -> int:
    if args.repro is not None:
        return _print_reproduction(args.repro)
    # vLLM logs every recovery it runs; the canaries make it recover on purpose.
    loggers = [logging.getLogger(name) for name in ("vllm", "kvmetrics")]
    levels = [logger.level for logger in loggers]
    if not args.verbose:
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
    try:
        return _check(args)
    finally:  # an in-process caller keeps its logging
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _print_reproduction(defect_id: str) -> int:
    from kvmetrics.lab.vllm.defect_regimes import SEVERITY

    if defect_id not in SEVERITY:
        return fail(f"unknown defect {defect_id!r} (choose from {', '.join(SEVERITY)})")
    from kvmetrics.lab.vllm.series import PATCHES

    if not PATCHES.is_dir():
        return fail(f"{PATCHES} not found next to this kvmetrics: --repro needs a source "
                    "checkout of kvmetrics")
    print(reproduction(defect_id), end="")
    return 0


def _check(args: argparse.Namespace) -> int:
    try:
        from kvmetrics.lab.vllm import canaries
    except ImportError as e:
        return fail(f"vllm-check needs vLLM installed ({e}); {VLLM_INSTALL_HINT}")
    known = [d.id for d in canaries.DEFECTS]
    unknown = sorted(set(args.only or ()) - set(known))
    if unknown:
        return fail(f"unknown defect {unknown[0]!r} (choose from {', '.join(known)})")
    results = canaries.run_all(args.only)
    if args.json:
        print(json.dumps({"vllm_version": canaries.vllm_version(), "counts": counts(results),
                          "defects": [r.as_dict() for r in results]}, indent=2))
    else:
        print(render(canaries.vllm_version(), results))
    return EXIT_UNKNOWN if counts(results)["unknown"] else 0


def counts(results: list[Any]) -> dict[str, int]:
    """How many canaries found their defect present, absent, or could not tell."""
    return {"present": sum(r.present is True for r in results),
            "absent": sum(r.present is False for r in results),
            "unknown": sum(r.present is None for r in results)}


def render(version: str, results: list[Any]) -> str:
    state = {True: "PRESENT", False: "absent", None: "unknown"}
    width = max(len(r.id) for r in results) if results else 10
    n = counts(results)
    lines = [f"vLLM {version}, {len(results)} known recovery-path defects: "
             f"{n['present']} present, {n['absent']} absent, {n['unknown']} unknown"]
    if n["unknown"]:
        lines.append(f"{n['unknown']} canary(ies) could not run on this vLLM: those defects "
                     f"may be present (exit code {EXIT_UNKNOWN})")
    lines.append("")
    lines.append(f"{'defect':<{width}}  {'state':<8}  upstream")
    for r in results:
        refs = ", ".join(ref.replace("vllm-project/vllm", "") for ref in r.upstream) or "-"
        lines.append(f"{r.id:<{width}}  {state[r.present]:<8}  {refs}")
        lines.append(f"{'':<{width}}  {'':<8}  {r.detail}")
    lines.append("")
    lines.append("Mechanisms, reproductions and patches: docs/vllm-defects.md")
    return "\n".join(lines)


COMMAND = Command(
    "vllm-check", "check the installed vLLM for known KV-recovery defects", _add, _run,
    description="Replay each known recovery-path defect of vLLM as a minimal scenario on "
    "the installed vLLM's own scheduler and report which are present "
    "(docs/vllm-defects.md). Exit codes: 0 every canary answered (present or absent), "
    f"{EXIT_UNKNOWN} at least one could not run on this vLLM (unknown, never counted as "
    "absent), 2 bad arguments or no vLLM.",
    examples=(
        "kvmetrics vllm-check                      # a table",
        "kvmetrics vllm-check --json               # for scripts: present true/false/null",
        "kvmetrics vllm-check --only async-load-stall",
        "kvmetrics vllm-check --repro async-sharer-in-flight > test_async_sharer.py",
    ))
