"""'Did you mean' for a mistyped option: the closest option of the sub-command typed.

argparse reports unknown options from the top-level parser, which knows nothing of the
sub-command's options (and Python 3.11 has no ``suggest_on_error``), so the message is
built here from the sub-parser that the parsed namespace names.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence


def _chosen_parser(parser: argparse.ArgumentParser,
                   parsed: argparse.Namespace) -> argparse.ArgumentParser:
    name = getattr(parsed, "command", None)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser


def unrecognized_message(parser: argparse.ArgumentParser, parsed: argparse.Namespace,
                         extras: Sequence[str]) -> str:
    """argparse's 'unrecognized arguments' line, with the closest known option of each."""
    chosen = _chosen_parser(parser, parsed)
    known = [option for action in chosen._actions for option in action.option_strings]
    hints = []
    for extra in extras:
        if not extra.startswith("--"):
            continue
        option = extra.split("=", 1)[0]
        close = difflib.get_close_matches(option, known, n=1, cutoff=0.6)
        if close:
            hints.append(f"{option}: did you mean {close[0]}?")
    message = "unrecognized arguments: " + " ".join(extras)
    if hints:
        message += " (" + "; ".join(hints) + ")"
    return message
