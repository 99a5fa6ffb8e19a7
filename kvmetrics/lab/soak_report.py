"""What a soak reports, and how shard reports merge into the report of the whole campaign.

A report carries everything a merge needs: the campaign (seed range, engines,
modes), which shard of it ran, every count, and every failing scenario (not a
sample), so the merge of a complete set of shards equals, field for field, the
report one process would have written for the whole campaign; only
``wall_seconds`` differs (a merge sums the shards' wall times).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: Bumped when the report's shape changes; a merge refuses other versions.
REPORT_VERSION = 1
COUNTS = ("invariant_violations", "guard_rejected_increments", "verification_failed_blocks",
          "errors")


class SoakReportError(ValueError):
    """Reports that cannot be merged (or a bad shard spec); the message says why."""


@dataclass(frozen=True)
class Campaign:
    """The whole campaign: scenarios ``seed .. seed + scenarios - 1`` on each engine."""

    scenarios: int
    seed: int
    engines: tuple[str, ...]
    accounting: str
    verify: str
    recovery: str

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "engines": list(self.engines)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Campaign:
        return cls(int(data["scenarios"]), int(data["seed"]), tuple(data["engines"]),
                   str(data["accounting"]), str(data["verify"]), str(data["recovery"]))


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (0-based, as a Kubernetes completion index)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        head, sep, tail = text.partition("/")
        if not sep or not head.strip().isdigit() or not tail.strip().isdigit():
            raise SoakReportError(f"shard must be I/N with 0 <= I < N, got {text!r}")
        index, count = int(head), int(tail)
        if count < 1 or index >= count:
            raise SoakReportError(f"shard must be I/N with 0 <= I < N, got {text!r}")
        return cls(index, count)

    def seeds(self, campaign: Campaign) -> range:
        """A contiguous slice of the seed range; the slices of 0..N-1 cover it exactly."""
        n = campaign.scenarios
        lo = self.index * n // self.count
        hi = (self.index + 1) * n // self.count
        return range(campaign.seed + lo, campaign.seed + hi)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass
class ScenarioOutcome:
    seed: int
    engine: str
    invariant_violations: int
    guard_rejected_increments: int
    verification_failed_blocks: int
    error: str | None = None

    @property
    def clean(self) -> bool:
        return not (self.invariant_violations or self.guard_rejected_increments
                    or self.verification_failed_blocks or self.error)

    @property
    def label(self) -> str:
        return f"{self.engine}:{self.seed}"


@dataclass
class SoakReport:
    campaign: Campaign
    shard: Shard | None = None
    scenarios: int = 0
    invariant_violations: int = 0
    guard_rejected_increments: int = 0
    verification_failed_blocks: int = 0
    errors: int = 0
    wall_seconds: float = 0.0
    failures: list[ScenarioOutcome] = field(default_factory=list)
    #: The signal that stopped the campaign early (the counts cover what finished).
    interrupted: int | None = None

    def add(self, outcome: ScenarioOutcome) -> None:
        self.scenarios += 1
        self.invariant_violations += outcome.invariant_violations
        self.guard_rejected_increments += outcome.guard_rejected_increments
        self.verification_failed_blocks += outcome.verification_failed_blocks
        self.errors += outcome.error is not None
        if not outcome.clean:
            self.failures.append(outcome)

    @property
    def failed(self) -> bool:
        """A finding that must fail the soak: a crash or stale KV, in every accounting
        mode; and under the unified accounting also any guard rejection or broken
        invariant. The historical accounting exists to produce negative increments,
        and the invariants they break (a rollback "from 0 to 128"), so those are
        expected there."""
        if self.errors or self.verification_failed_blocks or self.interrupted:
            return True
        unified = self.campaign.accounting != "historical"
        return unified and bool(self.invariant_violations or self.guard_rejected_increments)

    def seed_range(self) -> range:
        return (self.shard or Shard(0, 1)).seeds(self.campaign)

    def as_dict(self) -> dict[str, Any]:
        seeds = self.seed_range()
        return {
            "version": REPORT_VERSION,
            "campaign": self.campaign.as_dict(),
            "shard": None if self.shard is None or self.shard.count == 1 else str(self.shard),
            "seeds": [seeds.start, seeds.stop],
            "scenarios": self.scenarios,
            **{key: getattr(self, key) for key in COUNTS},
            "wall_seconds": round(self.wall_seconds, 2),
            "failing_seeds": [o.label for o in self.failures],
            "failures": [asdict(o) for o in self.failures],
            # Only on a cut-short report, so a complete one is the same for any --jobs.
            **({"interrupted": signal.Signals(self.interrupted).name}
               if self.interrupted else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SoakReport:
        if not isinstance(data, dict) or data.get("version") != REPORT_VERSION:
            raise SoakReportError(f"not a version-{REPORT_VERSION} soak report")
        try:
            shard = Shard.parse(data["shard"]) if data["shard"] else None
            report = cls(Campaign.from_dict(data["campaign"]), shard,
                         scenarios=int(data["scenarios"]),
                         wall_seconds=float(data["wall_seconds"]),
                         failures=[ScenarioOutcome(**o) for o in data["failures"]],
                         **{key: int(data[key]) for key in COUNTS})
        except (KeyError, TypeError, ValueError) as e:
            raise SoakReportError(f"malformed soak report ({type(e).__name__}: {e})") from None
        return report


def merge_reports(reports: Sequence[SoakReport]) -> SoakReport:
    """The campaign's report from one report per shard (all of them, each once)."""
    if not reports:
        raise SoakReportError("nothing to merge")
    campaign = reports[0].campaign
    for r in reports:
        if r.campaign != campaign:
            raise SoakReportError(f"reports of different campaigns: {r.campaign.as_dict()} vs "
                                  f"{campaign.as_dict()}")
    shards = [r.shard or Shard(0, 1) for r in reports]
    count = shards[0].count
    if any(s.count != count for s in shards):
        raise SoakReportError("reports split the campaign into different numbers of shards: "
                              + ", ".join(sorted({str(s) for s in shards})))
    seen = sorted(s.index for s in shards)
    if seen != list(range(count)):
        missing = sorted(set(range(count)) - set(seen))
        twice = sorted({i for i in seen if seen.count(i) > 1})
        what = [f"missing {', '.join(f'{i}/{count}' for i in missing)}" if missing else "",
                f"given twice {', '.join(f'{i}/{count}' for i in twice)}" if twice else ""]
        raise SoakReportError("incomplete set of shards: " + "; ".join(w for w in what if w))
    for r in reports:
        expected = len(r.seed_range()) * len(campaign.engines)
        if r.scenarios != expected:
            raise SoakReportError(f"shard {r.shard} ran {r.scenarios} scenarios, expected "
                                  f"{expected} (did it stop early?)")
    merged = SoakReport(campaign)
    order = {engine: i for i, engine in enumerate(campaign.engines)}
    for r in sorted(reports, key=lambda r: (r.shard or Shard(0, 1)).index):
        merged.scenarios += r.scenarios
        for key in COUNTS:
            setattr(merged, key, getattr(merged, key) + getattr(r, key))
        merged.wall_seconds += r.wall_seconds
        merged.failures.extend(r.failures)
    merged.failures.sort(key=lambda o: (o.seed, order.get(o.engine, len(order))))
    return merged
