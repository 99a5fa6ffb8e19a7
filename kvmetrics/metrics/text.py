"""Text from untrusted values, made safe for one error or log line.

Shared by every layer that reads user input (fault plans, traces, label values) or
reports a refused value (the guard): a value may be a 400-digit number, a megabyte of
JSON, or a string JSON could spell but UTF-8 cannot hold.
"""

from __future__ import annotations


def short_repr(value: object, limit: int = 80) -> str:
    """A repr fit for a log line, whatever the value: Python refuses to spell an int of
    more than 4300 digits, and a value's own ``__repr__`` may raise."""
    try:
        text = repr(value)
    except Exception:
        if isinstance(value, int):
            return f"<int of {value.bit_length()} bits>"
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def utf8_encodable(text: str) -> bool:
    """False for text no UTF-8 output can hold: JSON can spell lone surrogates
    ("\\ud800"), and a non-UTF-8 byte in argv or the environment becomes one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def terminal_safe(text: str) -> str:
    """``text`` with every character a terminal would act on, rather than show, escaped
    (``\\x1b``, ``\\u202e``): ESC sequences that recolour, retitle or clear the screen,
    carriage returns that overwrite a line, bidirectional overrides that reverse it.
    Everything printable, any script, is kept as it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else
                   (f"\\x{ord(c):02x}" if ord(c) < 0x100 else
                    f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}")
                   for c in text)
