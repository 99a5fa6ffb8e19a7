"""Label values: checking the ones a user sets, deriving the ones nobody set.

A value a user configures (``KVMETRICS_MODEL_NAME``, ``--model-name``,
``KVMETRICS_ENGINE``) is checked once, at startup, and a bad one is refused with one
line, because a bad one breaks every scrape later: a value that is not valid UTF-8 (a
non-UTF-8 byte in argv or the environment becomes a lone surrogate in Python) makes
rendering the page raise, so each scrape would be an HTTP 500 while the engine runs
on, unobserved. Characters that reorder or hide text (controls, U+202E and the other
bidirectional overrides and isolates, zero-width and filler characters such as U+200B,
U+FEFF, U+3164) are refused too: a dashboard would show the label spoofed, or two
replicas whose labels differ would look the same.

A value kvmetrics derives itself (the model name from vLLM's served model name or
model path, which a user never typed as a label) is never refused: a Hugging Face
snapshot path is longer than a label may be, and refusing it stopped vLLM from
starting. :func:`model_label` and :func:`derived_label_value` make any text a valid
label instead, escaped by the same rule as every displayed value
(:func:`~kvmetrics.metrics.text.escape_for_display`) and shortened with a stable hash
of the whole, so two long paths stay two labels.
"""

from __future__ import annotations

import hashlib
import re

from kvmetrics.metrics.text import escape_for_display, first_unsafe_for_display, utf8_encodable

#: Longest label value accepted (characters); a model name or an engine id is far
#: shorter, and Prometheus' own limits are configured per scrape job, not here.
MAX_LABEL_VALUE_LENGTH = 128
#: A derived value that had to be shortened ends with ``~`` and this many hex digits of
#: the SHA-256 of the whole value.
HASH_DIGITS = 8
#: Hugging Face's cache layout: ``.../models--ORG--NAME/snapshots/REVISION``.
_HF_SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+)/snapshots/[^/]+/*$")


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
    unsafe = first_unsafe_for_display(value)
    if unsafe is not None:
        return (f"contains U+{ord(unsafe):04X}, a control, bidirectional-formatting or "
                "invisible character (it would show other text than it holds)")
    return None


def check_label_value(what: str, value: object) -> None:
    """Raise ValueError with one line naming ``what`` if ``value`` is unusable."""
    problem = label_value_problem(value)
    if problem is not None:
        shown = ascii(value) if isinstance(value, str) else type(value).__name__
        if len(shown) > 60:
            shown = shown[:57] + "..."
        raise ValueError(f"{what} {shown} {problem}")


def derived_label_value(value: object, default: str = "default") -> str:
    """A valid label value made from ``value``, whatever it is; ``value`` itself when it
    already is one.

    Otherwise: ``default`` for nothing at all; characters that reorder or hide text
    escaped (``\\u202e``); anything still too long as its last path components, cut
    from the left to fit, after ``...`` and before ``~`` and a hash of the whole value
    (stable across restarts and processes, so two long paths stay two labels)."""
    text = value if isinstance(value, str) else ("" if value is None else _text_of(value))
    if label_value_problem(text) is None:
        return text
    if not text.strip("/ "):
        return default
    shown = escape_for_display(text)
    if len(shown) <= MAX_LABEL_VALUE_LENGTH:
        return shown
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_DIGITS]
    room = MAX_LABEL_VALUE_LENGTH - len(digest) - len("...~")
    return f"...{_tail(shown.rstrip('/'), room)}~{digest}"


def model_label(served_model_name: object, model: object) -> str:
    """The ``model_name`` label when no one set it: vLLM's served model name (which
    vLLM sets to the model path when ``--served-model-name`` is not given), made a valid
    label by :func:`derived_label_value`. A model path in the Hugging Face cache
    (``.../models--ORG--NAME/snapshots/REVISION``) is labelled ``ORG/NAME``: what
    ``vllm serve ORG/NAME`` is labelled, wherever the cache lives."""
    name = served_model_name or model
    if isinstance(name, str) and name == model:
        repo = _HF_SNAPSHOT.search(name)
        if repo is not None:
            org, _, rest = repo.group(1).partition("--")
            name = f"{org}/{rest}" if rest else org
    return derived_label_value(name)


def _tail(path: str, room: int) -> str:
    """The last whole components of ``path`` that fit in ``room`` characters (the end of
    the last one if even it does not fit): the part of a path that names the model."""
    tail = ""
    for part in reversed(path.split("/")):
        joined = f"{part}/{tail}" if tail else part
        if len(joined) > room:
            break
        tail = joined
    return tail or path[-room:]


def _text_of(value: object) -> str:
    try:
        text = str(value)
    except Exception:
        text = ""
    return text if isinstance(text, str) else ""
