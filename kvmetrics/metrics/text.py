"""Text from untrusted values, made safe for one error or log line, a terminal or a page.

Shared by every layer that reads user input (fault plans, traces, label values) or
reports a refused value (the guard): a value may be a 400-digit number, a megabyte of
JSON, a string JSON could spell but UTF-8 cannot hold, or a name that holds a line
feed, an escape sequence or a right-to-left override (U+202E) that makes the text
around it read as something else.

:func:`escape_for_display` is the one escaping rule for text a person reads: the HTML
report, the terminal and the logs all use it, so a value looks the same in each and
none of them can be spoofed by it.
"""

from __future__ import annotations

import re

#: Characters that move or hide the text around them: C0/C1 controls (line feeds,
#: ESC sequences), the line and paragraph separators, every format character (Unicode
#: category Cf: the bidirectional marks, embeddings, overrides and isolates, and the
#: zero-width ones, U+200B, U+2060, U+FEFF, the tag characters), the Hangul fillers
#: (U+115F, U+1160, U+3164, U+FFA0: letters that draw nothing), and lone surrogates
#: (no UTF-8 output can hold them). Two label values that differ only by one of
#: these would look the same on a dashboard. The Cf list is Unicode 15.1's
#: (tests/test_hostile_config.py checks it against the running Python's).
_UNSAFE_FOR_DISPLAY = re.compile(
    "[\x00-\x1f\x7f-\x9f\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2"
    "\u115f\u1160\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f"
    "\u3164\ud800-\udfff\ufeff\uffa0\ufff9-\ufffb\U000110bd\U000110cd"
    "\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001"
    "\U000e0020-\U000e007f]")
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    short = _SHORT_ESCAPES.get(char)
    if short is not None:
        return short
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape_for_display(text: str) -> str:
    """``text`` with every character that could hide or reorder what is shown spelt as
    a Python-style escape (a line feed as ``\\n``, ESC as ``\\x1b``, U+202E as
    ``\\u202e``); all other text, including any script, accents and emoji, is unchanged.
    The result is one line and valid UTF-8. Backslashes are kept as they are: the rule
    is there against spoofing, not to make every string reversible."""
    if _UNSAFE_FOR_DISPLAY.search(text) is None:
        return text
    return _UNSAFE_FOR_DISPLAY.sub(_escaped, text)


def first_unsafe_for_display(text: str) -> str | None:
    """The first character :func:`escape_for_display` would escape, or None."""
    match = _UNSAFE_FOR_DISPLAY.search(text)
    return None if match is None else match.group()


def short_repr(value: object, limit: int = 80) -> str:
    """A repr fit for a log line, whatever the value: bounded to about ``limit``
    characters, one line with nothing that can reorder it (a value's own ``__repr__``
    may return line feeds or a U+202E), and never raising (Python refuses to spell an
    int of more than 4300 digits, and a value's own ``__repr__`` may raise)."""
    try:
        if isinstance(value, str | bytes) and len(value) > limit:
            value = value[:limit + 1]  # a megabyte string is not copied to be cut again
        text = repr(value)
        if not isinstance(text, str):
            raise TypeError("__repr__ returned a non-string")
    except Exception:
        if isinstance(value, int):
            return f"<int of {value.bit_length()} bits>"
        try:
            text = f"<{type(value).__name__}>"
        except Exception:
            text = "<unrepresentable value>"
    text = escape_for_display(text[:limit + 1])
    return text if len(text) <= limit else text[:limit] + "..."


def short_text(value: object, limit: int = 200) -> str:
    """A value that is meant to be text (a request id, a label value), for a log line:
    a string is shown as it is (escaped, bounded), anything else as :func:`short_repr`."""
    if type(value) is str:
        if len(value) <= limit:
            return escape_for_display(value)
        return escape_for_display(value[:limit]) + "..."
    return short_repr(value, limit)


def utf8_encodable(text: str) -> bool:
    """False for text no UTF-8 output can hold: JSON can spell lone surrogates
    ("\\ud800"), and a non-UTF-8 byte in argv or the environment becomes one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
