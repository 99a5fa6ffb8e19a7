"""What every ``kvmetrics`` command shares: one-line errors, the command surface, output.

A command is a small module that builds its own sub-parser and runs the parsed
arguments; :mod:`kvmetrics.cli.main` lists them, so registering one is an import
and a line in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line (no usage dump) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"kvmetrics: error: {message}\n")


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    #: Adds the command's options to its sub-parser.
    add_arguments: Callable[[argparse.ArgumentParser], None]
    #: Runs the parsed arguments; returns the exit code.
    run: Callable[[argparse.Namespace], int]
    description: str = ""
    #: Example command lines, shown under "examples:" in ``--help``.
    examples: tuple[str, ...] = ()


def add_command(sub: argparse._SubParsersAction, command: Command) -> argparse.ArgumentParser:
    epilog = None
    if command.examples:
        epilog = "examples:\n" + "\n".join(f"  {line}" for line in command.examples)
    parser = sub.add_parser(command.name, help=command.help,
                            description=command.description or command.help, epilog=epilog,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    command.add_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.set_defaults(handler=command.run)
    return parser


def choice_list(allowed: Callable[[], Iterable[str]], what: str) -> Callable[[str], list[str]]:
    """An argparse ``type`` for comma-separated values from a fixed set."""

    def parse(text: str) -> list[str]:
        names = list(allowed())
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected one or more {what}s")
        for value in values:
            if value not in names:
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {value!r} (choose from {', '.join(names)})")
        return values

    return parse


def fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"kvmetrics: error: {message}", file=sys.stderr)
    return code


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


def check_output_path(path: str | None) -> str | None:
    """The problem with writing to ``path``, or None (checked before any work is done)."""
    if path is None:
        return None
    target = Path(path)
    if target.is_dir():
        return f"{path} is a directory, not a file"
    if not target.parent.exists():
        return f"output directory {target.parent} does not exist"
    return None


def write_atomically(path: str, text: str) -> None:
    """Write via a temp file and rename, so a failed run never truncates an old result."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
    try:
        # mkstemp makes the file private (0600); give it the mode open() would have.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the main thread so that ``finally`` blocks run (the
    lab writes what it has, workers are stopped). A KeyboardInterrupt, so that no
    ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupt_exit_code(error: BaseException) -> int:
    """128 + the signal number, as a shell reports a process killed by it (130, 143)."""
    return 128 + int(getattr(error, "signum", signal.SIGINT))


@contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Interrupted` once; further ones are ignored
    while the command cleans up (SIGKILL still ends it)."""
    fired = False

    def handler(signum: int, frame: object) -> None:
        nonlocal fired
        if fired:
            return
        fired = True
        raise Interrupted(signum)

    try:
        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread (an embedding): leave signals alone
        yield
        return
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def say(message: str) -> None:
    """A line of narration on stderr: what the command is doing or has done."""
    print(f"kvmetrics: {message}", file=sys.stderr, flush=True)
