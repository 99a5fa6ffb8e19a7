"""The ``kvmetrics`` command: a thin layer over the lab that turns bad input into one line.

Each sub-command lives in its own module as a :class:`~kvmetrics.cli.common.Command`;
to add one, import its module here and append its ``COMMAND`` to :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvmetrics import __version__
from kvmetrics.cli import (
    catalogue,
    demo_model,
    report,
    run,
    soak,
    soak_merge,
    vllm_check,
    workloads,
)
from kvmetrics.cli.common import (
    EXIT_USAGE,
    Command,
    Parser,
    add_command,
    interrupt_exit_code,
    interruptible,
    say,
    setup_logging,
)

COMMANDS: tuple[Command, ...] = (
    run.COMMAND,
    report.COMMAND,
    soak.COMMAND,
    soak_merge.COMMAND,
    workloads.COMMAND,
    catalogue.COMMAND,
    vllm_check.COMMAND,
    demo_model.COMMAND,
)


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    parser = Parser(prog="kvmetrics", description="Observability and a lab for KV-cache "
                    "load failures and recovery in vLLM-style engines.")
    parser.add_argument("--version", action="version", version=f"kvmetrics {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in commands:
        add_command(sub, command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return EXIT_USAGE
    setup_logging(args.verbose)
    try:
        with interruptible():
            return handler(args)
    except KeyboardInterrupt as e:  # commands write what they have before it gets here
        name = e.args[0] if e.args else "SIGINT"
        say(f"interrupted ({name})")
        return interrupt_exit_code(e)


if __name__ == "__main__":
    sys.exit(main())
