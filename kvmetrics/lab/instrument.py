"""The instrumented wrapper: an engine in, the same engine plus metrics out.

It forwards every call unchanged and, after each completed step, pushes the
step's events through the metrics pipeline. It never feeds anything back into
the engine, which is what makes it transparent (tests compare schedules with and
without it).
"""

from __future__ import annotations

from typing import Any

from kvmetrics.metrics.guard import CounterViolationError
from kvmetrics.metrics.logs import get_logger
from kvmetrics.metrics.pipeline import MetricsPipeline

log = get_logger("kvmetrics.lab.instrument")


class InstrumentedEngine:
    def __init__(self, engine: Any, pipeline: MetricsPipeline) -> None:
        self.engine = engine
        self.pipeline = pipeline

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        result = self.engine.update_from_output(*args, **kwargs)
        self.flush()
        return result

    def flush(self) -> None:
        """Record every finished step; metric faults are logged, never raised (unless strict)."""
        try:
            for events in self.engine.drain_events():
                self.pipeline.record(events)
        except CounterViolationError:
            raise
        except Exception:
            log.exception("kvmetrics failed to record a step; the engine continues")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
