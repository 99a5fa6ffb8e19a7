"""Every statement of the supported vLLM range agrees with the one place that defines it.

The range is the set of vLLM versions kvmetrics was verified on
(``kvmetrics/vllm/verified_vllm.json``, written by the fingerprint
recorder). A range written by hand in the README, a doc or a docstring ("0.28 to 0.33")
goes stale the day a version is added; this test finds every range that starts at the
oldest supported minor (or below it) and fails when its end is not the newest one.
Ranges that start above the oldest minor ("0.32-0.34", where the protective recovery is
verified) are narrower claims and are left alone.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvmetrics.vllm.fingerprints import load

ROOT = Path(__file__).resolve().parent.parent
#: "0.28 to 0.34", "0.28-0.34", "0.28.0 to 0.34.0", "0.28–0.34", "0.28..0.34".
RANGE = re.compile(r"\b0\.(\d{2})(?:\.\d+)?\s*(?:to|through|-|–|—|\.\.)\s*0\.(\d{2})(?:\.\d+)?\b")


def supported_minors() -> tuple[int, int]:
    minors = sorted(int(version.split(".")[1]) for version in load())
    assert minors, "verified_vllm.json lists no vLLM version"
    return minors[0], minors[-1]


def stale_ranges(text: str, oldest: int, newest: int) -> list[str]:
    """The version ranges in ``text`` that claim to start at the supported floor (or
    below it) but end elsewhere than the newest supported minor."""
    return [match.group(0) for match in RANGE.finditer(text)
            if int(match.group(1)) <= oldest < int(match.group(2)) != newest
            or int(match.group(1)) < oldest < int(match.group(2))]


def scanned_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted((ROOT / "kvmetrics").rglob("*.py"))]


def test_the_range_comes_from_the_verified_versions() -> None:
    oldest, newest = supported_minors()
    assert oldest < newest


def test_no_doc_or_docstring_states_another_range() -> None:
    oldest, newest = supported_minors()
    stale = []
    for path in scanned_files():
        text = path.read_text(encoding="utf-8")
        stale += [f"{path.relative_to(ROOT)}: {found}"
                  for found in stale_ranges(text, oldest, newest)]
    assert stale == [], f"supported vLLM is 0.{oldest} to 0.{newest}: {stale}"


def test_the_scan_finds_a_stale_range_and_passes_the_right_one() -> None:
    assert stale_ranges("vLLM 0.28 to 0.33, 0.28–0.31", 28, 34) == ["0.28 to 0.33", "0.28–0.31"]
    assert stale_ranges("vLLM 0.27-0.34", 28, 34) == ["0.27-0.34"]
    assert stale_ranges("vLLM 0.28 to 0.34, 0.28.0 to 0.34.0, 0.32-0.34, 0.28-0.9 %",
                        28, 34) == []


#: What an operator must read to deploy: the README, the user guide and the runbook.
OPERATOR_DOCS = ("README.md", "docs/user-guide.md", "docs/runbook.md")
OPERATOR_DOCS_MAX_LINES = 900


def test_the_docs_an_operator_must_read_stay_within_their_budget() -> None:
    lines = {name: len((ROOT / name).read_text(encoding="utf-8").splitlines())
             for name in OPERATOR_DOCS}
    assert sum(lines.values()) < OPERATOR_DOCS_MAX_LINES, lines
