"""Fuzzing the trace and fault-plan parsers: bad input only ever gets the clean error."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmetrics.lab.engine.faults import FaultPlan, FaultPlanError
from kvmetrics.lab.traces import TraceError, load_trace

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                 max_size=5),
    max_leaves=12,
)
KEYS = ("timestamp", "input_length", "output_length", "hash_ids", "id", "arrival_s",
        "prompt_token_ids", "prefix_block_ids", "prompt_length", "block_tokens")
# Records that look almost right: known keys with arbitrary values.
NEAR_RECORDS = st.dictionaries(st.sampled_from(KEYS), JSON, max_size=6)
LINES = st.lists(st.one_of(NEAR_RECORDS.map(json.dumps), JSON.map(json.dumps),
                           st.text(max_size=40)), min_size=0, max_size=5)

FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def _write(lines: list[str]) -> Path:
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False,
                                     encoding="utf-8") as handle:
        handle.write("\n".join(lines))
    return Path(handle.name)


@FUZZ
@given(lines=LINES, fmt=st.sampled_from(("kvmetrics", "mooncake")))
def test_trace_parser_raises_only_trace_errors(lines: list[str], fmt: str) -> None:
    path = _write(lines)
    try:
        items = load_trace(path, fmt)
    except TraceError as e:
        assert str(e) and "\n" not in str(e)
    else:
        for item in items:
            assert len(item.prompt) >= 1 and item.max_tokens >= 1 and item.arrival_s >= 0
    finally:
        path.unlink()


@FUZZ
@given(data=JSON | st.dictionaries(st.sampled_from(("rate", "seed", "failures")), JSON))
def test_fault_plan_parser_raises_only_fault_plan_errors(data: object) -> None:
    try:
        plan = FaultPlan.from_dict(data)
    except FaultPlanError as e:
        assert str(e) and "\n" not in str(e)
    else:
        assert 0.0 <= plan.rate <= 1.0
        plan.fails(1, "r", 0)


@FUZZ
@given(text=st.text(max_size=200))
def test_fault_plan_files_with_any_text(text: str) -> None:
    path = _write([text])
    try:
        FaultPlan.load(path)
    except FaultPlanError as e:
        assert "\n" not in str(e)
    finally:
        path.unlink()
