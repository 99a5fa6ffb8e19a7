"""Admission, aborts, cache resets, the store connector and the engine loop."""

from __future__ import annotations

import pytest

from kvmetrics.exporters.prometheus import PrometheusSink
from kvmetrics.lab.engine.config import ConfigError
from kvmetrics.lab.engine.connector import StoreConnector, choose_load_mode
from kvmetrics.lab.engine.executor import EOS_TOKEN_ID, SimulatedExecutor
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.loop import EngineLoop
from kvmetrics.lab.engine.request import Request, RequestStatus
from kvmetrics.lab.engine.scheduler import Scheduler, SchedulerConfig
from kvmetrics.lab.engine.tokens import ExplicitTokens
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.engine import assert_no_leaks, block_hashes, build_rig, make_request, preload
from tests.helpers.engine import tokens as token_range
from tests.helpers.metrics import sample
from tests.helpers.scenarios import async_failure, sync_failure


@pytest.mark.parametrize(("field", "value", "message"), [
    ("block_size", 0, "block_size must be a positive integer"),
    ("num_gpu_blocks", 1, "at least 2"),
    ("max_num_seqs", True, "max_num_seqs must be a positive integer"),
    ("kv_load_failure_policy", "retry", "kv_load_failure_policy must be one of"),
    ("accounting", "old", "accounting must be one of"),
])
def test_impossible_configurations_name_the_field(field: str, value: object,
                                                  message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig(**{field: value})  # type: ignore[arg-type]


def test_requests_are_validated_on_arrival() -> None:
    sched = Scheduler(SchedulerConfig(max_model_len=100))
    sched.add_request(make_request("a", token_range(0, 10)))
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        sched.add_request(make_request("a", token_range(0, 10)))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_request("b", []))
    with pytest.raises(ValueError, match="more than max_model_len 100"):
        sched.add_request(make_request("c", token_range(0, 90), max_tokens=11))


def test_a_request_the_cache_can_never_hold_is_refused_instead_of_waiting_forever() -> None:
    config = SchedulerConfig(block_size=4, num_gpu_blocks=4)  # 3 usable blocks, 12 tokens
    rig = build_rig(config, connector=False)
    with pytest.raises(ValueError, match="needs up to 4 KV blocks of 4 tokens, more than the 3"):
        rig.add(make_request("big", token_range(0, 10), max_tokens=4))
    # 10 prompt + 3 outputs: the last output is sampled, never computed, so 12 fit.
    rig.add(make_request("fits", token_range(0, 10), max_tokens=3))
    rig.run()
    assert rig.requests["fits"].status is RequestStatus.FINISHED_LENGTH
    assert_no_leaks(rig.scheduler)


def test_connector_never_offers_the_last_token_and_stops_at_the_first_gap() -> None:
    store = ExternalStoreIndex(16)
    connector = StoreConnector(store, 16, "sync")
    prompt = token_range(0, 64)
    hashes = block_hashes(prompt)
    request = make_request("r", prompt)
    request.update_block_hashes(16)

    preload(store, hashes)  # all 4 blocks stored: the 4th holds the last token
    assert connector.get_num_new_matched_tokens(request, 0) == (48, False)
    assert connector.get_num_new_matched_tokens(request, 16) == (32, False)

    store.discard(hashes[1])
    assert connector.get_num_new_matched_tokens(request, 0) == (16, False)
    assert connector.get_num_new_matched_tokens(request, 16) == (0, False)
    with pytest.raises(ValueError, match="load mode must be one of"):
        StoreConnector(store, 16, "eager")


def test_mixed_load_mode_is_decided_per_request_and_repeatable() -> None:
    modes = [choose_load_mode("mixed", f"req-{i}", seed=5) for i in range(200)]
    assert modes == [choose_load_mode("mixed", f"req-{i}", seed=5) for i in range(200)]
    assert 60 < modes.count("async") < 140
    assert choose_load_mode("sync", "x") == "sync"
    assert choose_load_mode("async", "x") == "async"


def test_abort_during_an_async_load_keeps_the_blocks_until_the_transfer_ends() -> None:
    pipeline = MetricsPipeline(strict=True)
    rig = async_failure("recompute", pipeline, async_delay_steps=2)
    rig.step()
    pool = rig.scheduler.pool
    assert pool.num_used_blocks == 5

    assert rig.abort("r") is True
    assert rig.abort("r") is False
    assert rig.requests["r"].status is RequestStatus.FINISHED_ABORTED
    assert not rig.scheduler.has_unfinished_requests()
    assert pool.num_used_blocks == 5  # the transfer may still write into them
    rig.step()
    assert pool.num_used_blocks == 5
    rig.step()  # the transfer reports finished: now they are released
    assert rig.last_result.finished_recving == {"r"}
    assert not rig.busy()
    assert_no_leaks(rig.scheduler)
    assert pipeline.totals.get(cat.FINISHED_REQUESTS, reason="aborted") == 1
    assert pipeline.totals.get(cat.KV_LOAD_FAILED_REQUESTS) == 0  # nobody left to fail


def test_abort_of_a_running_request_frees_its_blocks_at_once() -> None:
    rig = sync_failure("recompute")
    rig.step()
    rig.step()
    assert rig.abort("r") is True
    assert_no_leaks(rig.scheduler)
    assert rig.abort("missing") is False


def test_cache_reset_only_when_idle_and_counted_as_reset_evictions() -> None:
    pipeline = MetricsPipeline(strict=True)
    rig = sync_failure("recompute", pipeline, max_tokens=20)
    rig.step()
    assert rig.scheduler.reset_prefix_cache() is False  # r holds blocks
    rig.run()
    cached = len(rig.scheduler.pool.cached)
    assert cached == 5  # 64 prompt + 19 output tokens = 5 full blocks
    assert rig.scheduler.reset_prefix_cache() is True
    assert rig.scheduler.pool.cached == {}
    rig.step()  # counted with the next step
    assert pipeline.totals.get(cat.EVICTED_BLOCKS, cause="reset") == cached


def test_gauges_report_requests_by_state_and_cache_usage(
    prometheus_sink: PrometheusSink,
) -> None:
    pipeline = MetricsPipeline([prometheus_sink])
    config = SchedulerConfig(block_size=16, num_gpu_blocks=11, max_num_seqs=1)
    rig = build_rig(config, load_mode="async", pipeline=pipeline)
    preload(rig.store, block_hashes(token_range(0, 64))[:2])
    rig.add(make_request("loading", token_range(0, 64), 2),
            make_request("running", token_range(500, 40), 2),
            make_request("queued", token_range(900, 40), 2))
    rig.step()
    registry = prometheus_sink.registry
    # "loading" waits for its transfer; "running" took the only seat; "queued" waits.
    assert sample(registry, "kvmetrics_requests", state="waiting_for_remote_kv") == 1
    assert sample(registry, "kvmetrics_requests", state="running") == 1
    assert sample(registry, "kvmetrics_requests", state="waiting") == 1
    # 2 blocks for "loading" (only those to load, until it lands) and 3 for "running".
    assert sample(registry, "kvmetrics_kv_cache_usage_ratio") == pytest.approx(5 / 10)
    rig.run()
    assert sample(registry, "kvmetrics_kv_cache_usage_ratio") == 0


def test_sampling_the_eos_token_stops_a_request() -> None:
    sched = Scheduler(SchedulerConfig(block_size=16, num_gpu_blocks=16))
    runner = SimulatedExecutor(eos_probability=1.0)
    request = Request("r", ExplicitTokens(token_range(0, 20)), max_tokens=10,
                      eos_token_id=EOS_TOKEN_ID)
    sched.add_request(request)
    loop = EngineLoop(sched, runner)
    assert loop.run() == 1
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [EOS_TOKEN_ID]


def test_engine_loop_gives_up_after_max_steps() -> None:
    sched = Scheduler(SchedulerConfig(block_size=16, num_gpu_blocks=16))
    sched.add_request(make_request("r", token_range(0, 20), max_tokens=10))
    loop = EngineLoop(sched, SimulatedExecutor())
    with pytest.raises(RuntimeError, match="unfinished after 3 steps"):
        loop.run(max_steps=3)
    assert loop.run() == 7  # the rest: 10 tokens in 10 steps
    assert_no_leaks(sched)
