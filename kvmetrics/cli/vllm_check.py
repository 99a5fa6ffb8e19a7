"""``kvmetrics vllm-check``: run the defect canaries on the installed vLLM.

Operators run it before an upgrade, vLLM developers on a fix: each known
recovery-path defect is replayed as a minimal scenario on vLLM's own scheduler
(docs/vllm-defects.md). The table says present / absent / unknown (a canary that
cannot run on this vLLM's internals says why); ``--json`` prints
``{"vllm_version": ..., "defects": [{"id", "present", "summary", "upstream"}]}``
(plus each canary's ``detail``). vLLM is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from kvmetrics.cli.common import Command, fail


def _add(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--only", metavar="ID", action="append",
                   help="run only this defect's canary (repeatable)")


def _run(args: argparse.Namespace) -> int:
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


def _check(args: argparse.Namespace) -> int:
    try:
        from kvmetrics.integrations.vllm import canaries
    except ImportError as e:
        return fail(f"vllm-check needs vLLM installed ({e}); see README 'vLLM integration'")
    known = [d.id for d in canaries.DEFECTS]
    unknown = sorted(set(args.only or ()) - set(known))
    if unknown:
        return fail(f"unknown defect {unknown[0]!r} (choose from {', '.join(known)})")
    results = canaries.run_all(args.only)
    if args.json:
        print(json.dumps({"vllm_version": canaries.vllm_version(),
                          "defects": [r.as_dict() for r in results]}, indent=2))
    else:
        print(render(canaries.vllm_version(), results))
    return 0


def render(version: str, results: list[Any]) -> str:
    state = {True: "PRESENT", False: "absent", None: "unknown"}
    width = max(len(r.id) for r in results) if results else 10
    lines = [f"vLLM {version}: {sum(r.present is True for r in results)} of {len(results)} "
             "known recovery-path defects present", ""]
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
    "(docs/vllm-defects.md).",
    examples=(
        "kvmetrics vllm-check                      # a table",
        "kvmetrics vllm-check --json               # for scripts: present true/false/null",
        "kvmetrics vllm-check --only async-load-stall",
    ))
