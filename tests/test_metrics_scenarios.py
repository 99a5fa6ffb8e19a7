"""Exact counter values for the named KV-path scenarios, through the metrics pipeline."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.guard import CounterViolationError
from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.metrics import pipeline_counters, sample
from tests.helpers.scenarios import (
    async_failure,
    preemption_after_partial_hit,
    preemption_before_first_output,
    shared_failed_block,
    sync_failure,
)

Q, H = cat.PREFIX_CACHE_QUERY_TOKENS.name, cat.PREFIX_CACHE_HIT_TOKENS.name
PROMPT = cat.PROMPT_TOKENS.name
BLOCKS, FAILED_REQS = cat.KV_LOAD_BLOCKS.name, cat.KV_LOAD_FAILED_REQUESTS.name
ROLLED, RECOMPUTED = cat.ROLLED_BACK_TOKENS.name, cat.RECOMPUTED_TOKENS.name
EVICTED, PREEMPTED = cat.EVICTED_BLOCKS.name, cat.PREEMPTIONS.name
FINISHED = cat.FINISHED_REQUESTS.name


def _pipeline(strict: bool = True) -> tuple[MetricsPipeline, CollectorRegistry]:
    sink = PrometheusSink(CollectorRegistry())
    return MetricsPipeline([sink], strict=strict), sink.registry


def _lookups(local: int, ext: int, queried: int) -> dict:
    return {(Q, ("local", "first")): queried, (H, ("local", "first")): local,
            (Q, ("external", "first")): queried - local, (H, ("external", "first")): ext}


def _without_zeros(series: dict) -> dict:
    return {k: v for k, v in series.items() if v}


def test_sync_failure_recompute_counts() -> None:
    pipeline, registry = _pipeline()
    rig = sync_failure("recompute", pipeline)
    rig.step()
    after_failure = pipeline_counters(pipeline)
    assert after_failure == _without_zeros({
        **_lookups(local=0, ext=48, queried=64),
        (PROMPT, ("compute",)): 16, (PROMPT, ("external",)): 48,
        (BLOCKS, ("sync", "ok")): 2, (BLOCKS, ("sync", "failed")): 1,
        (FAILED_REQS, ("sync", "recompute", "rescheduled")): 1,
        (ROLLED, ("sync", "recompute")): 32,
    })
    assert sample(registry, "kvmetrics_recovery_duration_seconds_count") == 1
    assert sample(registry, "kvmetrics_requests", state="running") == 1

    rig.step()  # 16..64 again: 32 rolled back + 16 discarded with the failed step
    assert pipeline.totals.get(cat.RECOMPUTED_TOKENS, cause="kv_load_failure") == 48
    rig.run()
    assert pipeline_counters(pipeline) == {
        **after_failure,
        (RECOMPUTED, ("kv_load_failure",)): 48,
        (FINISHED, ("length",)): 1,
    }
    assert sample(registry, "kvmetrics_recovery_duration_seconds_count") == 1
    assert sample(registry, "kvmetrics_kv_load_blocks_total", mode="sync", outcome="ok") == 2
    assert sample(registry, "kvmetrics_rolled_back_tokens_total", mode="sync",
                  policy="recompute") == 32


def test_sync_failure_fail_counts() -> None:
    pipeline, registry = _pipeline()
    rig = sync_failure("fail", pipeline)
    rig.run()
    assert pipeline_counters(pipeline) == _without_zeros({
        **_lookups(local=0, ext=48, queried=64),
        (PROMPT, ("compute",)): 16, (PROMPT, ("external",)): 48,
        (BLOCKS, ("sync", "ok")): 2, (BLOCKS, ("sync", "failed")): 1,
        (FAILED_REQS, ("sync", "fail", "failed")): 1,
        (ROLLED, ("sync", "fail")): 32,
        (EVICTED, ("kv_load_failure",)): 3,
        (FINISHED, ("error",)): 1,
    })
    assert sample(registry, "kvmetrics_finished_requests_total", reason="error") == 1
    assert sample(registry, "kvmetrics_requests", state="running") == 0


def test_async_failure_recompute_counts_blocks_when_the_load_reports() -> None:
    pipeline, registry = _pipeline()
    rig = async_failure("recompute", pipeline, async_delay_steps=2)
    rig.step()
    assert pipeline.totals.get(cat.KV_LOAD_BLOCKS) == 0  # still in flight
    assert sample(registry, "kvmetrics_requests", state="waiting_for_remote_kv") == 1
    rig.step()
    rig.step()
    assert pipeline.totals.get(cat.KV_LOAD_BLOCKS, mode="async", outcome="ok") == 4
    assert pipeline.totals.get(cat.KV_LOAD_BLOCKS, mode="async", outcome="failed") == 1
    rig.run()
    assert pipeline_counters(pipeline) == _without_zeros({
        **_lookups(local=0, ext=80, queried=96),
        (PROMPT, ("compute",)): 16, (PROMPT, ("external",)): 80,
        (BLOCKS, ("async", "ok")): 4, (BLOCKS, ("async", "failed")): 1,
        (FAILED_REQS, ("async", "recompute", "rescheduled")): 1,
        (ROLLED, ("async", "recompute")): 48,
        (RECOMPUTED, ("kv_load_failure",)): 48,
        (FINISHED, ("length",)): 1,
    })


def test_async_failure_fail_counts() -> None:
    pipeline, _ = _pipeline()
    rig = async_failure("fail", pipeline, async_delay_steps=1)
    rig.run()
    assert pipeline_counters(pipeline) == _without_zeros({
        **_lookups(local=0, ext=80, queried=96),
        (PROMPT, ("compute",)): 16, (PROMPT, ("external",)): 80,
        (BLOCKS, ("async", "ok")): 4, (BLOCKS, ("async", "failed")): 1,
        (FAILED_REQS, ("async", "fail", "failed")): 1,
        (ROLLED, ("async", "fail")): 48,
        (FINISHED, ("error",)): 1,
    })


def test_shared_failed_block_counts_both_requests_and_recomputes_each_token_once() -> None:
    pipeline, _ = _pipeline()
    rig = shared_failed_block("recompute", pipeline)
    rig.run()
    assert pipeline_counters(pipeline) == {
        # a: 64 queried locally, 48 matched externally; b: 48 of 64 found locally.
        (Q, ("local", "first")): 128, (H, ("local", "first")): 48,
        (Q, ("external", "first")): 64 + 16, (H, ("external", "first")): 48,
        (PROMPT, ("compute",)): 32, (PROMPT, ("external",)): 48,
        (PROMPT, ("local_cache",)): 48,
        (BLOCKS, ("sync", "ok")): 2, (BLOCKS, ("sync", "failed")): 1,
        (FAILED_REQS, ("sync", "recompute", "rescheduled")): 2,
        (ROLLED, ("sync", "recompute")): 32,  # a only; b keeps its pre-step 48
        # a redoes 16..64 (48), b redoes its discarded 48..64 (16)
        (RECOMPUTED, ("kv_load_failure",)): 64,
        (FINISHED, ("length",)): 2,
    }


def test_preemption_counts_repeat_lookups_and_recompute_by_preemption() -> None:
    pipeline, registry = _pipeline()
    rig = preemption_after_partial_hit(pipeline)
    rig.run()
    assert pipeline_counters(pipeline) == {
        # w: 40 tokens, nothing cached; a: 32, nothing; b: 48, 32 cached (w's head).
        (Q, ("local", "first")): 40 + 32 + 48, (H, ("local", "first")): 32,
        # b again after its preemption: 48 prompt + 1 output token, the head still cached.
        (Q, ("local", "repeat")): 49, (H, ("local", "repeat")): 32,
        (PROMPT, ("compute",)): 40 + 32 + 16, (PROMPT, ("local_cache",)): 32,
        (PREEMPTED, ()): 1,
        (RECOMPUTED, ("preemption",)): 16,
        # a's third block was b's cached tail; b's fourth came from a's freed head.
        (EVICTED, ("capacity",)): 2,
        (FINISHED, ("length",)): 3,
    }
    assert sample(registry, "kvmetrics_preemptions_total") == 1


# -- historical accounting through the pipeline ------------------------------------------


def test_historical_negative_increment_is_refused_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pipeline, registry = _pipeline(strict=False)
    rig = preemption_before_first_output("historical", pipeline)
    with caplog.at_level(logging.ERROR, logger="kvmetrics.guard"):
        rig.run()

    assert all(r.is_finished for r in rig.requests.values())  # the engine kept going
    assert sample(registry, "kvmetrics_guard_rejected_increments_total", reason="negative",
                  metric="kvmetrics_prompt_tokens_total") == 1
    assert pipeline.totals.get(cat.GUARD_REJECTED_INCREMENTS) == 1
    assert pipeline.totals.get(cat.INVARIANT_VIOLATIONS) == 0
    (violation,) = pipeline.violations
    assert (violation.request_id, violation.kind) == ("x", "negative")
    (record,) = [r for r in caplog.records if r.name == "kvmetrics.guard"]
    assert "request=x" in record.getMessage()
    assert f"at step {violation.step}" in record.getMessage()
    assert "-16" in record.getMessage()
    # The refused amount reached no exporter: local_cache stayed at zero.
    assert (sample(registry, "kvmetrics_prompt_tokens_total", source="local_cache") or 0) == 0
    assert sample(registry, "kvmetrics_prompt_tokens_total", source="external") == 16


def test_historical_negative_increment_raises_in_strict_mode() -> None:
    pipeline, _ = _pipeline(strict=True)
    rig = preemption_before_first_output("historical", pipeline)
    with pytest.raises(CounterViolationError) as info:
        rig.run()
    assert info.value.violation.metric == "kvmetrics_prompt_tokens_total"
    assert info.value.violation.kind == "negative"
    assert info.value.violation.request_id == "x"


def test_unified_accounting_of_the_historical_scenario_has_no_violation() -> None:
    pipeline, registry = _pipeline(strict=True)
    rig = preemption_before_first_output("unified", pipeline)
    rig.run()
    assert pipeline.violations == []
    assert sample(registry, "kvmetrics_prompt_tokens_total", source="compute") == 16 + 64
    assert pipeline.totals.get(cat.PREFIX_CACHE_HIT_TOKENS, source="external",
                               admission="repeat") == 16
    assert pipeline.totals.get(cat.PREEMPTIONS) == 1
