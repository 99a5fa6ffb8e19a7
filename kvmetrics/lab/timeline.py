"""The run's timeline: what the pipeline exported, step by step, for the run report.

:class:`TimelineSink` is one more :class:`~kvmetrics.metrics.sink.MetricSink` of
the run's pipeline, so it sees exactly the guarded increments and gauges that
Prometheus sees (nothing is recounted), and the lab loop closes a step after
each engine step. Long runs are bucketed: once there are ``max_points`` buckets,
neighbours merge pairwise and the bucket width doubles, so memory and the saved
JSON stay bounded whatever the run's length. Counters are summed per bucket;
gauges are averaged over the bucket's steps (the value carried from the last
change when a step did not set it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import GaugeReadings

DEFAULT_MAX_POINTS = 400

#: (metric, own label values or None for any) -> timeline series. The label tuples
#: exclude the common labels (model_name, engine).
_COUNTER_SERIES: dict[str, Any] = {
    cat.PREFIX_CACHE_QUERY_TOKENS.name: lambda v: (f"{v[0]}_query_tokens"
                                                   if v[1] == "first" else None),
    cat.PREFIX_CACHE_HIT_TOKENS.name: lambda v: (f"{v[0]}_hit_tokens"
                                                 if v[1] == "first" else None),
    cat.KV_LOAD_BLOCKS.name: lambda v: f"load_blocks_{v[1]}",
    cat.ROLLED_BACK_TOKENS.name: lambda v: "rolled_back_tokens",
    cat.RECOMPUTED_TOKENS.name: lambda v: f"recomputed_tokens_{v[0]}",
    cat.EVICTED_BLOCKS.name: lambda v: f"evicted_blocks_{v[0]}",
    cat.PREEMPTIONS.name: lambda v: "preemptions",
    cat.FINISHED_REQUESTS.name: lambda v: f"finished_{v[0]}",
    cat.KV_VERIFIED_TOKENS.name: lambda v: "verified_tokens",
    cat.KV_VERIFICATION_FAILED_BLOCKS.name: lambda v: "verification_failed_blocks",
    cat.GUARD_REJECTED_INCREMENTS.name: lambda v: "guard_rejected_increments",
    cat.INVARIANT_VIOLATIONS.name: lambda v: "invariant_violations",
}
GAUGES = ("kv_cache_usage", "running", "waiting", "waiting_for_remote_kv")
_NCOMMON = len(cat.COMMON_LABELS)


@dataclass
class _Bucket:
    first_step: int
    last_step: int = 0
    steps: int = 0
    #: Wall seconds since the run started, at the end of the bucket's last step.
    wall_s: float | None = None
    counters: dict[str, float] = field(default_factory=dict)
    #: Sum over the bucket's steps of each gauge (divided by ``steps`` on output).
    gauges: dict[str, float] = field(default_factory=dict)

    def absorb(self, other: _Bucket) -> None:
        self.last_step = other.last_step
        self.steps += other.steps
        self.wall_s = other.wall_s
        for key, value in other.counters.items():
            self.counters[key] = self.counters.get(key, 0.0) + value
        for key, value in other.gauges.items():
            self.gauges[key] = self.gauges.get(key, 0.0) + value


class TimelineSink:
    """A metrics sink that keeps per-step (then per-bucket) sums for the report."""

    def __init__(self, max_points: int = DEFAULT_MAX_POINTS) -> None:
        if max_points < 2:
            raise ValueError("max_points must be at least 2")
        self.max_points = max_points
        self.width = 1
        self.buckets: list[_Bucket] = []
        self._open: _Bucket | None = None
        self._pending: dict[str, float] = {}
        self._gauges = dict.fromkeys(GAUGES, 0.0)

    # -- MetricSink ------------------------------------------------------------------

    def inc(self, spec: cat.MetricSpec, label_values: tuple[str, ...], amount: float) -> None:
        to_series = _COUNTER_SERIES.get(spec.name)
        if to_series is None or not amount:
            return
        key = to_series(label_values[_NCOMMON:])
        if key is not None:
            self._pending[key] = self._pending.get(key, 0.0) + amount

    def set(self, spec: cat.MetricSpec, label_values: tuple[str, ...], value: float) -> None:
        if spec is cat.KV_CACHE_USAGE:
            self._gauges["kv_cache_usage"] = value
        elif spec is cat.REQUESTS:
            self._gauges[label_values[_NCOMMON]] = value

    def set_gauges(self, common: tuple[str, ...], readings: GaugeReadings) -> None:
        self._gauges.update(kv_cache_usage=readings.kv_cache_usage, running=readings.running,
                            waiting=readings.waiting,
                            waiting_for_remote_kv=readings.waiting_for_remote_kv)

    def observe(self, spec: cat.MetricSpec, label_values: tuple[str, ...],
                value: float) -> None:
        pass

    def info(self, spec: cat.MetricSpec, label_values: tuple[str, ...]) -> None:
        pass

    # -- called by the lab loop ------------------------------------------------------

    def close_step(self, step: int, wall_s: float | None = None) -> None:
        """Everything recorded since the last call belongs to engine step ``step``, which
        ended ``wall_s`` seconds into the run (for a wall-time axis; None: not known)."""
        bucket = self._open
        if bucket is None:
            bucket = self._open = _Bucket(first_step=step)
        bucket.last_step = step
        bucket.wall_s = wall_s
        bucket.steps += 1
        for key, value in self._pending.items():
            bucket.counters[key] = bucket.counters.get(key, 0.0) + value
        self._pending.clear()
        for key, value in self._gauges.items():
            bucket.gauges[key] = bucket.gauges.get(key, 0.0) + value
        if bucket.steps >= self.width:
            self.buckets.append(bucket)
            self._open = None
            if len(self.buckets) > self.max_points:
                self._halve()

    def _halve(self) -> None:
        merged = []
        for i in range(0, len(self.buckets) - 1, 2):
            a = self.buckets[i]
            a.absorb(self.buckets[i + 1])
            merged.append(a)
        if len(self.buckets) % 2:  # an odd one out is the start of a wider bucket
            self._open = self.buckets[-1]
        self.buckets = merged
        self.width *= 2

    # -- output ----------------------------------------------------------------------

    def as_dict(self) -> dict[str, Any]:
        """Columnar: one list per series, one entry per bucket (series never set: omitted)."""
        buckets = list(self.buckets) + ([self._open] if self._open is not None else [])
        names = sorted({k for b in buckets for k in b.counters})
        walls = [b.wall_s for b in buckets if b.wall_s is not None]
        return {
            "bucket_steps": self.width,
            # Only when every bucket knows its wall time (the lab loop records it).
            **({"wall_s": [round(w, 4) for w in walls]}
               if walls and len(walls) == len(buckets) else {}),
            "first_step": [b.first_step for b in buckets],
            "last_step": [b.last_step for b in buckets],
            "counters": {n: [_num(b.counters.get(n, 0.0)) for b in buckets] for n in names},
            "gauges": {g: [round(b.gauges.get(g, 0.0) / max(b.steps, 1), 4) for b in buckets]
                       for g in GAUGES},
        }


def _num(value: float) -> int | float:
    return int(value) if float(value).is_integer() else round(value, 6)
