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
