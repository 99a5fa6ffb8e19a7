"""A progress bar on stderr (rich's), only when stderr is a terminal.

Callers update it every step; it passes an update on to rich at most ten times a
second, so the lab loop pays a clock read per step and nothing more. Off a
terminal it draws nothing, so logs and piped output stay plain.
"""

from __future__ import annotations

import time
from contextlib import suppress
from typing import Any


class Progress:
    def __init__(self, total: int, enabled: bool = True, unit: str = "requests") -> None:
        self.total = max(total, 1)
        self.enabled = enabled
        self.unit = unit
        self._last = 0.0
        self._bar: Any = None
        self._task: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[progress.description]{task.description}"), BarColumn(),
                MofNCompleteColumn(), TextColumn(unit), TimeElapsedColumn(),
                TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[note]}"),
                console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task("kvmetrics", total=self.total, note="")
            self._bar.start()

    def update(self, done: int, step: int | None = None, note: str = "",
               force: bool = False) -> None:
        if self._bar is None:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        text = " ".join(part for part in (f"step {step}" if step is not None else "", note)
                        if part)
        self._bar.update(self._task, completed=min(done, self.total), note=text)

    def close(self) -> None:
        if self._bar is not None:
            bar, self._bar = self._bar, None
            # After a hangup the terminal is gone: its last redraw fails with EIO, which
            # must not replace the interrupt that is summarising and writing the run.
            with suppress(OSError):
                bar.stop()
