"""Counter cross-checks against figures vLLM computes itself, shown to catch a vLLM that
does the counted work past kvmetrics' hooks.

Each test runs vLLM's real scheduler twice on the same fault workload: as it is (every
check quiet) and changed the way a release could change it without renaming anything
kvmetrics checks at start, the work inlined where the hook cannot see it. The counter
then falls short of vLLM's own figure, and the check counts it in
``kvmetrics_self_check_failures_total{check}``.
"""

from __future__ import annotations

import functools
import types

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.metrics.stats import PrefillStats

from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.vllm.differential import random_workload, run_vllm
from kvmetrics.metrics import catalogue as cat
from kvmetrics.vllm import step_end
from kvmetrics.vllm.event_hooks import EventHooks
from tests.test_vllm_hooks import run_failing_load, totals
from tests.test_vllm_recorder_flags import CONFIG as FLAGS_CONFIG

pytestmark = pytest.mark.vllm

CHECKS = cat.SELF_CHECK_FAILURES.name


def checks(got: dict) -> dict[str, float]:
    return {key[1][0]: value for key, value in got.items() if key[0] == CHECKS and value}


def finish_run() -> dict:
    engine = run_failing_load()
    for _ in range(2 * step_end.GAUGE_EVERY):  # idle steps: the periodic gauge read comes
        engine.step()
    got = totals(engine)
    assert engine.outcome("r")[0] == "length" and engine.outcome("s")[0] == "length"
    engine.close()
    return got


def test_a_finish_vllm_makes_past_the_hook_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    """``requests_finished``: every request kvmetrics tracks must still be vLLM's."""
    monkeypatch.setattr(step_end, "GAUGE_MIN_INTERVAL_S", 0)
    assert checks(finish_run()) == {}
    monkeypatch.setattr(EventHooks, "_free_request",
                        lambda self, *args, **kwargs: Scheduler._free_request(self, *args,
                                                                             **kwargs))
    got = finish_run()
    assert not [key for key in got if key[0] == cat.FINISHED_REQUESTS.name and got[key]]
    assert checks(got) == {"requests_finished": 2}


def test_a_rollback_vllm_makes_past_the_hook_is_flagged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``kv_load_failed_requests``: vLLM's own count in its recovery log line."""
    baseline = run_failing_load()
    got = totals(baseline)
    baseline.close()
    assert got[(cat.KV_LOAD_FAILED_REQUESTS.name, ("sync", "recompute", "rescheduled"))] == 2
    assert checks(got) == {}

    # vLLM's recovery calling its helper where the override cannot see it (inlined).
    handle = Scheduler._handle_invalid_blocks

    @functools.wraps(handle)  # the same signature: the hook check at start passes
    def inlined(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        self._update_requests_with_invalid_blocks = types.MethodType(
            Scheduler._update_requests_with_invalid_blocks, self)
        try:
            return handle(self, *args, **kwargs)
        finally:
            del self._update_requests_with_invalid_blocks

    monkeypatch.setattr(Scheduler, "_handle_invalid_blocks", inlined)
    engine = run_failing_load()
    got = totals(engine)
    broken = engine.scheduler.kvmetrics_broken_hooks
    engine.close()
    assert broken == {}
    assert not [key for key in got if key[0] == cat.KV_LOAD_FAILED_REQUESTS.name and got[key]]
    assert checks(got) == {"kv_load_failed_requests": 2}


def preempting_run() -> dict:
    """Sync loads failing at 15% under recompute, in a cache tight enough to preempt."""
    run = run_vllm(FLAGS_CONFIG, random_workload(4, 60, load_mode="sync"),
                   FaultPlan(rate=0.15, seed=4))
    assert all(outcome[0] in ("length", "stopped") for outcome in run.outcomes.values())
    return dict(run.pipeline.totals.series())


def test_a_preemption_vllm_makes_past_the_hook_is_flagged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``preemptions``: each finished request's count against vLLM's ``num_preemptions``."""
    got = preempting_run()
    preemptions = sum(v for key, v in got.items() if key[0] == cat.PREEMPTIONS.name)
    assert preemptions > 0
    assert got[(cat.KV_LOAD_FAILED_REQUESTS.name, ("sync", "recompute", "rescheduled"))] > 0
    assert checks(got) == {}

    # vLLM preempting where the override cannot see it (its own method, called inline).
    monkeypatch.setattr(EventHooks, "_preempt_request",
                        lambda self, *args, **kwargs: Scheduler._preempt_request(
                            self, *args, **kwargs))
    got = preempting_run()
    assert not [key for key in got if key[0] == cat.PREEMPTIONS.name and got[key]]
    assert checks(got) == {"preemptions": preemptions}


def test_a_prompt_split_that_differs_from_vllms_is_flagged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``prompt_tokens``: each admission's split against vLLM's ``Request.prefill_stats``."""
    baseline = run_failing_load()
    got = totals(baseline)
    baseline.close()
    prompt = {key[1][0]: v for key, v in got.items() if key[0] == cat.PROMPT_TOKENS.name}
    assert prompt["external"] > 0 and prompt["local_cache"] > 0
    assert checks(got) == {}

    # A vLLM whose own split of the prompt differs (local and external swapped).
    set_split = PrefillStats.set

    def swapped(self, num_prompt_tokens, num_local_cached_tokens,  # noqa: ANN001, ANN202
                num_external_cached_tokens):
        set_split(self, num_prompt_tokens, num_external_cached_tokens, num_local_cached_tokens)

    monkeypatch.setattr(PrefillStats, "set", swapped)
    engine = run_failing_load()
    got = totals(engine)
    engine.close()
    assert {key[1][0]: v for key, v in got.items() if key[0] == cat.PROMPT_TOKENS.name} == prompt
    assert checks(got) == {"prompt_tokens": 2}
