"""Hostile values (issue 28, cases 1, 17, 18): whatever an engine, a user or a file hands
kvmetrics, the guard returns, log lines stay short single lines, derived label values
never stop an engine, and text that reorders or hides what is shown (control bytes,
U+202E) is shown escaped, by one rule, in logs, terminals and the report."""

from __future__ import annotations

import logging
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import CounterIncrement, StepEvents
from kvmetrics.metrics.guard import CounterViolationError, guard_increment
from kvmetrics.metrics.labels import derived_label_value, label_value_problem, model_label
from kvmetrics.metrics.pipeline import MetricsPipeline
from kvmetrics.metrics.text import escape_for_display, first_unsafe_for_display, short_repr

SPEC = cat.PREFIX_CACHE_QUERY_TOKENS
#: Longest log line the guard may write for one violation (about 1 KB; see guard.py).
MAX_LINE = 1200


class Unprintable:
    """A label value whose repr and comparison both raise."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no ==")

    __hash__ = object.__hash__


class Lying:
    """A value whose repr spans lines and reverses what follows it."""

    def __repr__(self) -> str:
        return "ok\nkvmetrics: all clear\u202e"


HOSTILE_LABELS = [None, (Unprintable(), "first"), ("x" * 10_000_000, "a\nb"),
                  (Lying(), "first"), "local", 42, [("deep",) * 3] * 100_000]
HOSTILE_AMOUNTS = [np.array([1, 2]), torch.tensor([1, 2]), Decimal("sNaN"),
                   np.array([]), Unprintable(), Lying()]


def _assert_one_safe_line(line: str) -> None:
    assert len(line) <= MAX_LINE, len(line)
    assert escape_for_display(line) == line, "an unescaped control or bidi character"


@pytest.mark.parametrize("labels", HOSTILE_LABELS, ids=range(len(HOSTILE_LABELS)))
@pytest.mark.parametrize("amount", [-1, 5])
def test_the_guard_returns_whatever_the_labels(labels: object, amount: int) -> None:
    inc = CounterIncrement(SPEC, amount, labels, "r\n" * 3_000_000)  # type: ignore[arg-type]
    value, violation = guard_increment(inc, 3)
    assert value != value and violation is not None  # refused: negative or bad labels
    _assert_one_safe_line(violation.describe())


@pytest.mark.parametrize("labels", HOSTILE_LABELS, ids=range(len(HOSTILE_LABELS)))
def test_the_pipeline_counts_and_logs_one_bounded_line(
        labels: object, caplog: pytest.LogCaptureFixture) -> None:
    pipeline = MetricsPipeline()
    with caplog.at_level(logging.ERROR, logger="kvmetrics.guard"):
        pipeline.record(StepEvents(7, [
            CounterIncrement(SPEC, -1, labels, "req\u202e-1"),  # type: ignore[arg-type]
            CounterIncrement(cat.PREEMPTIONS, 1)]))
    assert pipeline.totals.get(cat.PREEMPTIONS) == 1  # the rest of the step counts
    assert pipeline.totals.get(cat.GUARD_REJECTED_INCREMENTS, metric=SPEC.name) == 1
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvmetrics.guard"]
    _assert_one_safe_line(line)
    assert "request=req\\u202e-1" in line


def test_a_negative_increment_names_its_labels_shortened() -> None:
    inc = CounterIncrement(cat.ROLLED_BACK_TOKENS, -128, ("sync", "y" * 5000), "chat-1")
    _, violation = guard_increment(inc, 4)
    assert violation is not None
    line = violation.describe()
    assert line.startswith("refused negative increment of kvmetrics_rolled_back_tokens_total "
                           "at step 4 request=chat-1: amount -128 labels {'mode': 'sync', "
                           "'policy': 'yyyy")
    _assert_one_safe_line(line)


@pytest.mark.parametrize("amount", HOSTILE_AMOUNTS, ids=range(len(HOSTILE_AMOUNTS)))
def test_step_events_count_anything_and_the_guard_refuses_it(
        amount: object, caplog: pytest.LogCaptureFixture) -> None:
    events = StepEvents(2)
    events.count(SPEC, amount, "local", "first", request_id="r")  # type: ignore[arg-type]
    pipeline = MetricsPipeline()
    with caplog.at_level(logging.ERROR, logger="kvmetrics.guard"):
        pipeline.record(events)
    assert pipeline.totals.get(cat.GUARD_REJECTED_INCREMENTS, metric=SPEC.name,
                               reason="not_a_number") == 1
    assert pipeline.totals.get(SPEC) == 0
    for record in caplog.records:
        _assert_one_safe_line(record.getMessage())


def test_strict_mode_raises_its_own_error_for_hostile_values() -> None:
    pipeline = MetricsPipeline(strict=True)
    events = StepEvents(2)
    events.count(SPEC, np.array([1, 2]), "local", "first")  # type: ignore[arg-type]
    with pytest.raises(CounterViolationError, match="refused not-a-number increment"):
        pipeline.record(events)
    with pytest.raises(CounterViolationError) as caught:
        pipeline.record(StepEvents(3, [CounterIncrement(SPEC, -1, None)]))  # type: ignore
    _assert_one_safe_line(str(caught.value))


def test_a_garbage_increment_is_refused_not_raised() -> None:
    pipeline = MetricsPipeline()
    pipeline.record(StepEvents(1, [SimpleNamespace(), CounterIncrement(cat.PREEMPTIONS, 1)]))  # type: ignore[list-item]
    assert pipeline.totals.get(cat.PREEMPTIONS) == 1
    assert pipeline.violations[0].metric == "<unknown metric>"


@pytest.mark.parametrize(("text", "shown"), [
    ("plain model/Llama-3 é 😀 \\u", "plain model/Llama-3 é 😀 \\u"),
    ("evil\u202egnp.exe", "evil\\u202egnp.exe"),
    ("a\nb\rc\td", "a\\nb\\rc\\td"),
    ("\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"),
    ("\u2066\u2067\u2068\u2069\u202a\u202b\u202c\u202d\u200e\u200f\u061c",
     "\\u2066\\u2067\\u2068\\u2069\\u202a\\u202b\\u202c\\u202d\\u200e\\u200f\\u061c"),
    ("\u2028\u2029\x85\x7f\ud800", "\\u2028\\u2029\\x85\\x7f\\ud800"),
])
def test_one_escaping_rule(text: str, shown: str) -> None:
    assert escape_for_display(text) == shown
    assert escape_for_display(shown) == shown  # escaped text stays as it is


def test_short_repr_is_bounded_single_line_and_never_raises() -> None:
    assert short_repr("x" * 10_000_000) == repr("x" * 80)[:80] + "..."
    assert short_repr(Unprintable()) == "<Unprintable>"
    assert short_repr(Lying()) == "ok\\nkvmetrics: all clear\\u202e"
    assert short_repr(10**5000) == "<int of 16610 bits>"


@pytest.mark.parametrize("value", [
    "/root/.cache/huggingface/hub/models--o--n/snapshots/" + "a" * 200,
    "/data/" + "x" * 300, "y" * 129, "evil\u202egnp", "a\nb", "caf\udce9", "", "/", None, 7,
    "/" + "z" * 500 + "/", "\u202e" * 200,
])
def test_a_derived_label_value_is_always_valid_and_stable(value: object) -> None:
    label = derived_label_value(value)
    assert label_value_problem(label) is None, (label, label_value_problem(label))
    assert derived_label_value(value) == label


def test_long_derived_values_keep_their_tail_and_differ_by_hash() -> None:
    a = derived_label_value("/data/" + "x" * 300 + "/run-1/checkpoint")
    b = derived_label_value("/data/" + "X" * 300 + "/run-1/checkpoint")
    assert a.startswith("...run-1/checkpoint~") and b.startswith("...run-1/checkpoint~")
    assert a != b and len(a) == len("...run-1/checkpoint~") + 8
    assert model_label(None, "/hub/models--gpt2/snapshots/abc") == "gpt2"
    assert model_label("my-chat", "/hub/models--o--n/snapshots/abc") == "my-chat"


def test_an_explicit_model_name_with_a_bidi_override_is_refused_by_the_lab() -> None:
    from kvmetrics.lab.config import LabConfig, LabError

    with pytest.raises(LabError, match=r"--model-name 'evil\\u202egnp' contains U\+202E"):
        LabConfig(model_name="evil\u202egnp").validate()


def test_file_names_with_a_bidi_override_are_shown_escaped_in_the_terminal(
        tmp_path: Path) -> None:
    from tests.lab_support import run_cli

    evil = tmp_path / "run\u202enosj.json"  # would read "run" + "json.son" reversed
    result = run_cli("run", "--verify", "off", "--max-requests", "3", "--output", str(evil))
    assert result.returncode == 0, result.stderr
    assert evil.exists()
    assert f"run written to {tmp_path}/run\\u202enosj.json" in result.stderr
    missing = run_cli("report", str(tmp_path / "gone\u202e\n.json"))
    assert missing.returncode == 2
    (line,) = missing.stderr.splitlines()
    assert "gone\\u202e\\n.json" in line and "\u202e" not in missing.stderr


def test_the_terminal_summary_escapes_what_the_run_file_holds() -> None:
    from kvmetrics.lab.summary import build_summary, render_table
    from kvmetrics.metrics.totals import Totals

    summary = build_summary(Totals(), engine="ref\u202eerence\x1b[2J[red]x",
                            submitted=1, wall_seconds=0.1, steps=1)
    summary["violations"] = [{
        "kind": "guard_rejection", "metric": "m", "reason": "negative", "count": 1,
        "first_step": 1, "first_request": "r\u202e1\n", "examples": ["a\x1b]0;title\x07"]}]
    for rich in (False, True):
        text = render_table(summary, rich=rich)
        assert "\u202e" not in text and "\x07" not in text and "\x1b[2J" not in text
        assert "ref\\u202eerence\\x1b[2J[red]x" in text and "a\\x1b]0;title\\x07" in text


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=()), max_size=400))
def test_any_text_escaped_is_one_safe_line_and_any_derived_label_is_valid(text: str) -> None:
    shown = escape_for_display(text)
    assert first_unsafe_for_display(shown) is None and "\n" not in shown
    shown.encode("utf-8")  # no lone surrogate left
    assert label_value_problem(derived_label_value(text)) is None
