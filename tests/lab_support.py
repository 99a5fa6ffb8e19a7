"""Shared bits of the lab tests: the trace location and the real console script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def mooncake_trace() -> Path:
    """The Mooncake trace the repository ships (data/traces/); never skipped if absent."""
    default = REPO / "data" / "traces" / "mooncake_conversation_trace.jsonl"
    path = Path(os.environ.get("KVMETRICS_MOONCAKE_TRACE", default))
    assert path.is_file(), (
        f"Mooncake trace not found at {path}: it ships in data/traces/ (or set "
        "KVMETRICS_MOONCAKE_TRACE)")
    return path


def console_script() -> str:
    script = Path(sys.executable).parent / "kvmetrics"
    assert script.is_file(), f"no kvmetrics console script next to {sys.executable}"
    return str(script)


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([console_script(), *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
