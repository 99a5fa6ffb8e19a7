"""HTML built so that a value cannot become markup: every value is escaped unless it
is :class:`Markup` (a literal of the page, or HTML this module built).

The run report fills its page from a file anyone may have edited. Escaping each value
at each place it is used left one place that forgot (a violation's ``first_step``);
here the template is the only markup, and every field put into it, of any type, is
escaped: HTML's special characters become entities, and characters that would reorder
or hide the text around them (controls, U+202E) are shown escaped by the same rule as
in a terminal or a log (:func:`~kvmetrics.metrics.text.escape_for_display`).
"""

from __future__ import annotations

import html as _html
import string
from collections.abc import Iterable
from typing import Any

from kvmetrics.metrics.text import escape_for_display


class Markup(str):
    """Text that is already HTML: a literal of the page or built by :func:`html`."""

    __slots__ = ()


def escape(value: Any) -> Markup:
    """``value`` as HTML text (Markup is kept as it is)."""
    if isinstance(value, Markup):
        return value
    return Markup(_html.escape(escape_for_display(str(value)), quote=True))


class _Escaping(string.Formatter):
    def format_field(self, value: Any, format_spec: str) -> str:
        if isinstance(value, Markup):
            return value
        return escape(format(value, format_spec))


_FORMATTER = _Escaping()


def html(template: str, /, *args: Any, **fields: Any) -> Markup:
    """``template`` (literal markup, ``str.format`` syntax: ``{name:,}``) with every
    field escaped, whatever its type, unless it is Markup."""
    return Markup(_FORMATTER.vformat(template, args, fields))


def join(parts: Iterable[Any], separator: str = "") -> Markup:
    """Parts (each escaped unless Markup) joined by a literal ``separator``."""
    return Markup(separator.join(escape(p) for p in parts))
