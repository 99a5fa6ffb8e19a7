"""A dependency-free progress bar on stderr, redrawn at most ten times a second."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.start = time.monotonic()
        self._last = 0.0

    def update(self, done: int, step: int, note: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = int(width * min(done, self.total) / self.total)
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(f"\r[{bar}] {done}/{self.total} requests  step {step}  "
                          f"{now - self.start:5.1f}s  {note}\033[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
