"""Recognise the data plane's strict-mode error without importing torch up front."""

from __future__ import annotations


def is_verification_error(error: BaseException) -> bool:
    return type(error).__name__ == "KVVerificationError"
