"""What a soak reports, and how shard reports merge into the report of the whole campaign.

A report carries everything a merge needs: the campaign (seed range, engines,
modes), which shard of it ran, every count, and every failing scenario (not a
sample), so the merge of a complete set of shards equals, field for field, the
report one process would have written for the whole campaign; only
``wall_seconds`` differs (a merge sums the shards' wall times).
"""

from __future__ import annotations

import hashlib
import signal
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from itertools import islice
from typing import Any

from kvmetrics.lab.config import VERIFY_MODES
from kvmetrics.lab.engine.config import ACCOUNTINGS, RECOVERIES
from kvmetrics.metrics import strict_json

#: Bumped when the report's shape changes; a merge refuses other versions
#: (2: the ``digest`` field).
REPORT_VERSION = 2
#: No shard runs this long (ten years); a larger wall time is an edited report, and
#: the sum over any number of shards stays a finite number.
MAX_WALL_SECONDS = 10 * 365 * 24 * 3600.0
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
        data = {
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
        return {**data, "digest": digest(data)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SoakReport:
        """A report read back from JSON, checked for being one `kvmetrics soak` could have
        written: every count a non-negative integer, the failures inside the shard's
        seed range and adding up to the counts (an edited report is refused)."""
        if not isinstance(data, dict) or data.get("version") != REPORT_VERSION:
            raise SoakReportError(f"not a version-{REPORT_VERSION} soak report")
        try:
            campaign = Campaign.from_dict(data["campaign"])
            _check_campaign(campaign)
            shard = Shard.parse(data["shard"]) if data["shard"] else None
            if shard is not None and shard.count > campaign.scenarios:
                raise SoakReportError(f"shard {shard} of {campaign.scenarios} scenarios is "
                                      "empty")
            report = cls(campaign, shard, scenarios=_count(data, "scenarios"),
                         wall_seconds=_wall_seconds(data["wall_seconds"]),
                         failures=[_outcome(o) for o in data["failures"]],
                         **{key: _count(data, key) for key in COUNTS})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, SoakReportError):
                raise
            raise SoakReportError(f"malformed soak report ({type(e).__name__}: "
                                  f"{str(e)[:80]})") from None
        if data.get("interrupted"):
            raise SoakReportError(f"the report of shard {shard or '0/1'} was interrupted "
                                  f"({str(data['interrupted'])[:20]}); rerun that shard")
        report._check_consistent()
        _check_digest(data)
        return report

    def _check_consistent(self) -> None:
        seeds = self.seed_range()
        expected = len(seeds) * len(self.campaign.engines)
        if self.scenarios > expected:
            raise SoakReportError(f"{self.scenarios} scenarios in a shard of {expected}")
        seen: set[tuple[int, str]] = set()
        for o in self.failures:
            if o.seed not in seeds or o.engine not in self.campaign.engines:
                raise SoakReportError(f"failure {o.engine[:40]}:{o.seed} is outside the "
                                      f"shard's seeds {seeds.start}..{seeds.stop - 1}")
            if (o.seed, o.engine) in seen or o.clean:
                raise SoakReportError(f"failure {o.engine[:40]}:{o.seed} is listed twice or "
                                      "has nothing failed")
            seen.add((o.seed, o.engine))
        if len(self.failures) > self.scenarios:
            raise SoakReportError(f"{len(self.failures)} failures in {self.scenarios} "
                                  "scenarios")
        sums = {"invariant_violations": 0, "guard_rejected_increments": 0,
                "verification_failed_blocks": 0, "errors": 0}
        for o in self.failures:
            sums["invariant_violations"] += o.invariant_violations
            sums["guard_rejected_increments"] += o.guard_rejected_increments
            sums["verification_failed_blocks"] += o.verification_failed_blocks
            sums["errors"] += o.error is not None
        for key, total in sums.items():
            if getattr(self, key) != total:
                raise SoakReportError(f"{key} is {getattr(self, key)} but its failures add "
                                      f"up to {total}")


#: What a campaign's modes may be (the values `kvmetrics soak` accepts).
_MODES = {"accounting": ACCOUNTINGS, "verify": VERIFY_MODES, "recovery": RECOVERIES}
#: No campaign is this large; a bigger number is an edited or corrupt report.
_MAX_SCENARIOS = 10**9


def _check_campaign(c: Campaign) -> None:
    if not 1 <= c.scenarios <= _MAX_SCENARIOS:
        raise SoakReportError(f"campaign scenarios must be within 1..{_MAX_SCENARIOS:,}")
    if not c.engines or len(c.engines) > 16 or not all(
            isinstance(e, str) and 0 < len(e) <= 40 and e.isprintable() for e in c.engines):
        raise SoakReportError("campaign engines must be 1..16 names of printable characters")
    for mode, allowed in _MODES.items():
        if getattr(c, mode) not in allowed:
            raise SoakReportError(f"campaign {mode} must be one of {', '.join(allowed)}")


def digest(data: dict[str, Any]) -> str:
    """A SHA-256 over the report's content (every field but the digest), in a canonical
    JSON spelling. It catches a shard edited by hand or by a script that does not
    recompute it (failures removed, counts zeroed consistently); it is not a signature:
    anyone who reads this function can recompute it (docs/soak.md)."""
    body = {k: v for k, v in data.items() if k != "digest"}
    text = strict_json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check_digest(data: dict[str, Any]) -> None:
    given = data.get("digest")
    if not isinstance(given, str):
        raise SoakReportError("the report has no digest (written by an older kvmetrics, or "
                              "edited): rerun the shard")
    if given != digest(data):
        raise SoakReportError("the report's digest does not match its content: it was "
                              "edited or damaged after the soak wrote it; rerun the shard")


def _wall_seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not 0 <= value <= MAX_WALL_SECONDS:  # NaN fails both bounds
        raise SoakReportError(f"wall_seconds must be a number from 0 to "
                              f"{MAX_WALL_SECONDS:g}, got {repr(value)[:40]}")
    return float(value)


def _count(data: dict[str, Any], key: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SoakReportError(f"{key} must be an integer >= 0, got {repr(value)[:40]}")
    return value


def _outcome(data: Any) -> ScenarioOutcome:
    if not isinstance(data, dict):
        raise SoakReportError("each failure must be an object")
    keys = ("seed", "engine", "invariant_violations", "guard_rejected_increments",
            "verification_failed_blocks", "error")
    if set(data) != set(keys):
        raise SoakReportError(f"a failure must have exactly the fields {', '.join(keys)}")
    error = data["error"]
    if not (isinstance(data["seed"], int) and not isinstance(data["seed"], bool)
            and isinstance(data["engine"], str) and (error is None or isinstance(error, str))):
        raise SoakReportError("a failure's seed is an integer, its engine and error strings")
    return ScenarioOutcome(data["seed"], data["engine"], _count(data, "invariant_violations"),
                           _count(data, "guard_rejected_increments"),
                           _count(data, "verification_failed_blocks"), error)


def merge_reports(reports: Sequence[SoakReport]) -> SoakReport:
    """The campaign's report from one report per shard (all of them, each once)."""
    if not reports:
        raise SoakReportError("nothing to merge")
    campaign = reports[0].campaign
    for r in reports:
        if r.campaign != campaign:
            differ = [k for k, v in r.campaign.as_dict().items() if campaign.as_dict()[k] != v]
            raise SoakReportError(f"reports of different campaigns (they differ in "
                                  f"{', '.join(differ)})")
    shards = [r.shard or Shard(0, 1) for r in reports]
    count = shards[0].count
    if any(s.count != count for s in shards):
        raise SoakReportError("reports split the campaign into different numbers of shards: "
                              + ", ".join(sorted({str(s) for s in shards})))
    # The shard count is a claim of the file (up to 10^9): nothing here is sized by
    # it, only by the reports given.
    seen = Counter(s.index for s in shards)
    if len(seen) != count or len(shards) != count:
        missing = (i for i in range(count) if i not in seen)
        twice = sorted(i for i, n in seen.items() if n > 1)
        what = [f"missing {_some(missing, count, count - len(seen))}" if len(seen) < count
                else "", f"given twice {_some(iter(twice), count, len(twice))}" if twice
                else ""]
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


def _some(indexes: Iterator[int], count: int, total: int, shown: int = 5) -> str:
    """The first few of ``total`` shard names and how many more: bounded in time and
    memory, whatever the shard count (only ``shown`` are taken from ``indexes``)."""
    names = ", ".join(f"{i}/{count}" for i in islice(indexes, shown))
    return names + (f" and {total - shown:,} more" if total > shown else "")
