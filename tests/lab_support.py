"""Shared bits of the lab tests: the trace location and the real console script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def mooncake_trace() -> Path:
    """The Mooncake trace beside the checkout (CI has it there); never skipped if absent."""
    default = REPO.parent / "shared" / "data" / "mooncake_conversation_trace.jsonl"
    path = Path(os.environ.get("KVMETRICS_MOONCAKE_TRACE", default))
    assert path.is_file(), (
        f"Mooncake trace not found at {path}: put it in ../shared/data/ beside the checkout or "
        "set KVMETRICS_MOONCAKE_TRACE (see README)")
    return path


def console_script() -> str:
    script = Path(sys.executable).parent / "kvmetrics"
    assert script.is_file(), f"no kvmetrics console script next to {sys.executable}"
    return str(script)


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([console_script(), *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
