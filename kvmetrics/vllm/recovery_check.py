"""A counter cross-check on the recovery path: vLLM's own count of failed-load requests.

Each call of vLLM's ``_handle_invalid_blocks`` that finds affected requests logs one line
with its own count of them: "Recovered from KV load failure: %d request(s) rescheduled"
(policy recompute, a warning) or "Failing %d request(s) due to KV load failure" (policy
fail, an error). kvmetrics counts the same requests from what its
``_update_requests_with_invalid_blocks`` hook saw (``kvmetrics_kv_load_failed_requests_total``).
A handler on vLLM's scheduler logger takes vLLM's number from the log record (its
arguments, not the formatted text) while that call runs on this thread, and the two are
compared when it returns, on every recovery call: a mismatch counts
``kvmetrics_self_check_failures_total{check="kv_load_failed_requests"}``. It catches a vLLM
that rolls requests back without the hooked helper (the work inlined in the caller) or
that changes which requests the caller counts.

The check runs only where vLLM's line is emitted (its logger enabled for warnings) and
costs nothing off the recovery path. vLLM's token count in the same line is not
compared: it adds, for a request sharing a failed block another request rolled back,
the tokens scheduled in the step (no figure kvmetrics exports has that meaning).
"""

from __future__ import annotations

import logging
import threading

CHECK = "kv_load_failed_requests"
_PREFIXES = ("Recovered from KV load failure", "Failing %d request(s) due to KV load failure")

_current = threading.local()


class RecoveryTally:
    """One recovery call: the failed-load requests kvmetrics counted, and vLLM's."""

    __slots__ = ("ours", "vllms")

    def __init__(self) -> None:
        self.ours = 0
        self.vllms = 0


class _RecoveryLines(logging.Handler):
    """Adds vLLM's count from its recovery line to the tally of the call running here."""

    def emit(self, record: logging.LogRecord) -> None:
        tally = getattr(_current, "tally", None)
        if tally is None or not isinstance(record.msg, str) \
                or not record.msg.startswith(_PREFIXES):
            return
        try:
            count = record.args[0] if isinstance(record.args, tuple) else None
            if not isinstance(count, int | float | str):
                raise TypeError(f"a count of type {type(count).__name__}")
            tally.vllms += int(count)
        except Exception:
            tally.vllms = -1  # unreadable: compared, it fails (never a silent pass)


_HANDLER = _RecoveryLines(logging.DEBUG)


def _vllm_logger() -> logging.Logger:
    from vllm.v1.core.sched import scheduler

    return logging.getLogger(scheduler.__name__)


def begin() -> RecoveryTally | None:
    """Watch one recovery call on this thread; None where vLLM would not log its line."""
    logger = _vllm_logger()
    if not logger.isEnabledFor(logging.WARNING):
        return None
    if _HANDLER not in logger.handlers:  # also after a logging reconfiguration
        logger.addHandler(_HANDLER)
    tally = _current.tally = RecoveryTally()
    return tally


def end() -> None:
    """Stop watching (the call returned or raised)."""
    _current.tally = None
