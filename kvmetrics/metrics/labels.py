"""Checks for the label values a user configures (``model_name``, ``engine``).

They are checked once, at startup, because a bad one breaks every scrape later: a
value that is not valid UTF-8 (a non-UTF-8 byte in argv or the environment becomes
a lone surrogate in Python) makes rendering the page raise, so each scrape would be
an HTTP 500 while the engine runs on, unobserved.
"""

from __future__ import annotations

import unicodedata

from kvmetrics.metrics.text import utf8_encodable

#: Longest label value accepted (characters); a model name or an engine id is far
#: shorter, and Prometheus' own limits are configured per scrape job, not here.
MAX_LABEL_VALUE_LENGTH = 128


def label_value_problem(value: object) -> str | None:
    """Why ``value`` cannot be a label value, or None if it can."""
    if not isinstance(value, str):
        return f"must be text, got {type(value).__name__}"
    if not value:
        return "must not be empty"
    if len(value) > MAX_LABEL_VALUE_LENGTH:
        return f"is {len(value)} characters long (at most {MAX_LABEL_VALUE_LENGTH})"
    if not utf8_encodable(value):
        return "is not valid UTF-8"
    if any(unicodedata.category(c) == "Cc" for c in value):
        return "contains control characters"
    return None


def check_label_value(what: str, value: object) -> None:
    """Raise ValueError with one line naming ``what`` if ``value`` is unusable."""
    problem = label_value_problem(value)
    if problem is not None:
        shown = ascii(value) if isinstance(value, str) else type(value).__name__
        if len(shown) > 60:
            shown = shown[:57] + "..."
        raise ValueError(f"{what} {shown} {problem}")
