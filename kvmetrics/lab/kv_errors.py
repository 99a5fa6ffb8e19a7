"""Recognise the data plane's strict-mode error without importing torch up front.

A ``KVVerificationError`` can only have been raised if its module was imported,
so the check looks the class up there instead of importing it (and torch) eagerly.
"""

from __future__ import annotations

import sys


def is_verification_error(error: BaseException) -> bool:
    verify = sys.modules.get("kvmetrics.lab.kv.verify")
    return verify is not None and isinstance(error, verify.KVVerificationError)
