"""What every ``kvmetrics`` command shares: one-line errors, the command surface, output.

A command is a small module that builds its own sub-parser and runs the parsed
arguments; :mod:`kvmetrics.cli.main` lists them, so registering one is an import
and a line in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, NoReturn

from kvmetrics.metrics import files, strict_json
from kvmetrics.metrics.text import escape_for_display

EXIT_USAGE = 2
#: The work was done (and its summary printed) but an output file could not be written.
EXIT_OUTPUT = 4
#: An error line never grows past this (a hostile file must not make a 50 MB line).
MAX_ERROR_CHARS = 400


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written, and every option's default shown in its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "default" in text.lower() or not action.option_strings \
                or action.default is argparse.SUPPRESS or action.nargs == 0:
            return text
        shown = "none" if action.default is None else "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


class Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line (no usage dump) and exits 2, and takes
    no abbreviations (``--fault-rat`` must not quietly mean ``--fault-rate``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"kvmetrics: error: {one_line(message)}\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            from kvmetrics.cli.suggest import unrecognized_message
            self.error(unrecognized_message(self, parsed, extras))
        return parsed


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
                            formatter_class=HelpFormatter)
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


def one_line(message: str) -> str:
    """A message as one bounded line: line feeds, other control bytes and bidi overrides
    escaped (the one rule of :func:`escape_for_display`), the middle cut if too long."""
    text = escape_for_display(message)
    if len(text) > MAX_ERROR_CHARS:
        half = MAX_ERROR_CHARS // 2
        text = f"{text[:half]} ... {text[-half:]}"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def fail(message: str, code: int = EXIT_USAGE) -> int:
    _to_stderr(f"kvmetrics: error: {one_line(message)}")
    return code


def _to_stderr(line: str) -> None:
    """A line on stderr, if there still is one: after a hangup the terminal is gone
    (writes fail with EIO), and that must not stop a command from writing its files."""
    with suppress(OSError):
        print(line, file=sys.stderr, flush=True)


def read_json_file(path: str) -> tuple[Any, str | None]:
    """(data, None) or (None, the one-line problem): not a regular file, too large, not
    UTF-8, not JSON, or numbers JSON cannot hold (NaN, 1e400, 5,000 digits)."""
    try:
        return strict_json.loads(files.read_text(path)), None
    except files.FileRefused as e:
        return None, str(e)
    except json.JSONDecodeError as e:
        return None, f"{path}: not JSON ({e.msg} at line {e.lineno})"
    except strict_json.JSONRefused as e:
        return None, f"{path}: {e}"
    except RecursionError:
        return None, f"{path}: JSON nested too deeply"


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file (existing or not)."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def clashing_paths(outputs: dict[str, str | None], inputs: dict[str, str | None]) -> str | None:
    """An output that would overwrite an input or another output ({option: path})."""
    named = [(o, p) for o, p in outputs.items() if p]
    for i, (option, path) in enumerate(named):
        for other, theirs in [*named[:i], *((o, p) for o, p in inputs.items() if p)]:
            if same_file(path, theirs):
                return f"{option} {path} is the same file as {other}"
    return None


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


def check_output_path(path: str | None) -> str | None:
    """The problem with writing to ``path``, or None (checked before any work is done):
    see :mod:`kvmetrics.metrics.files` for what is refused."""
    return None if path is None else files.check_output_path(path)



def write_output(path: str, text: str) -> bool:
    """Write an output file; on failure (a full disk, a path that turned into a device
    meanwhile) say so in one line and return False, so that the command can still
    print what it has and exit :data:`EXIT_OUTPUT`."""
    try:
        files.write_file(path, text)
    except files.FileRefused as e:
        fail(str(e))
        return False
    except OSError as e:
        fail(f"cannot write {path}: {e.strerror or e}")
        return False
    return True


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()


#: Signals that stop a command cleanly: Ctrl-C, ``kill``, and a hangup (the terminal or
#: SSH session closed, ``kill -HUP``), which would otherwise end it with nothing written.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP, raised in the main thread so that ``finally`` blocks run (the
    lab writes what it has, workers are stopped). A KeyboardInterrupt, so that no
    ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupt_exit_code(error: BaseException) -> int:
    """128 + the signal number, as a shell reports a process killed by it (130, 143,
    129 for SIGHUP)."""
    return 128 + int(getattr(error, "signum", signal.SIGINT))


@contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` once; further ones are ignored
    while the command cleans up (SIGKILL still ends it)."""
    fired = False

    def handler(signum: int, frame: object) -> None:
        nonlocal fired
        if fired:
            return
        fired = True
        raise Interrupted(signum)

    try:
        old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
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
    _to_stderr(f"kvmetrics: {escape_for_display(message)}")
