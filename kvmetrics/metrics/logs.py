"""Loggers whose lines a logged value cannot spoof.

kvmetrics logs values it did not choose: a multiprocess file's name, an OTLP endpoint,
a port-file path, a connector's error text, a request id. One holding a line feed
would forge a second log line; an escape sequence or a right-to-left override would
rewrite what an operator reads. Every kvmetrics logger carries :class:`OneLineFilter`,
which spells such characters as escapes (:func:`~kvmetrics.metrics.text.escape_for_display`,
the rule the report and the terminal use too) once the message is formatted. Logging
is rare (warnings, one line per problem), so the filter costs nothing that matters; a
record whose level is off never reaches it.
"""

from __future__ import annotations

import logging

from kvmetrics.metrics.text import escape_for_display


class OneLineFilter(logging.Filter):
    """Rewrites a record's message to one line with every unsafe character escaped."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format: logging reports that itself, unchanged
            return True
        escaped = escape_for_display(message)
        if escaped is not message:
            record.msg, record.args = escaped, None
        return True


_ONE_LINE = OneLineFilter()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with :class:`OneLineFilter` attached (once)."""
    logger = logging.getLogger(name)
    if _ONE_LINE not in logger.filters:
        logger.addFilter(_ONE_LINE)
    return logger
