"""The reference engine's KV-load recovery, preemption and accounting, step by step.

Every scenario uses block size 16 and exact token counts (see helpers/scenarios.py).
"""

from __future__ import annotations

from kvmetrics.lab.engine.request import RequestStatus
from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import CounterIncrement
from tests.helpers.engine import (
    Rig,
    assert_no_leaks,
    block_hashes,
    build_rig,
    fail_block,
    make_request,
    preload,
)
from tests.helpers.engine import tokens as token_range
from tests.helpers.scenarios import (
    ASYNC_PROMPT,
    PREEMPT_B,
    SHARED_A,
    SYNC_PROMPT,
    async_failure,
    preemption_after_partial_hit,
    preemption_before_first_output,
    shared_failed_block,
    sync_failure,
)


def _scheduled(rig: Rig) -> list[tuple[str, int, int]]:
    return list(rig.trace[-1].scheduled)


def _increments(rig: Rig) -> list[CounterIncrement]:
    return [inc for events in rig.scheduler.drain_events() for inc in events.increments]


# -- sync load failure --------------------------------------------------------------


def test_sync_failure_under_recompute_truncates_to_failed_block_then_recomputes() -> None:
    rig = sync_failure("recompute")
    r = rig.requests["r"]

    rig.step()
    assert _scheduled(rig) == [("r", 48, 16)]
    (load,) = rig.last_out.loads
    assert (load.mode, load.first_index, len(load.block_ids)) == ("sync", 0, 3)
    assert rig.last_result.invalid_block_ids == {load.block_ids[1]}
    # 64 computed after the step, truncated to the start of block #1: 32 tokens affected.
    assert r.num_computed_tokens == 16
    assert r.status is RequestStatus.RUNNING
    assert r.output_token_ids == []  # the step's sample was discarded

    rig.step()
    assert _scheduled(rig) == [("r", 16, 48)]
    assert r.num_computed_tokens == 64
    assert len(r.output_token_ids) == 1

    rig.run()
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert len(r.output_token_ids) == 4
    assert_no_leaks(rig.scheduler)


def test_sync_failure_under_recompute_keeps_failed_block_in_prefix_cache() -> None:
    rig = sync_failure("recompute")
    rig.step()
    failed = rig.scheduler.pool.blocks[rig.last_out.loads[0].block_ids[1]]
    # Not evicted: the owner recomputes it in place (vLLM's behaviour).
    assert failed.block_hash == block_hashes(SYNC_PROMPT)[1]


def test_sync_failure_under_fail_finishes_with_error_and_evicts_from_failed_block() -> None:
    rig = sync_failure("fail")
    r = rig.requests["r"]
    hashes = block_hashes(SYNC_PROMPT)

    rig.step()
    assert r.status is RequestStatus.FINISHED_ERROR
    assert r.output_token_ids == []
    pool = rig.scheduler.pool
    # Block #0 loaded fine and stays cached; #1 failed; #2 and #3 chain on #1.
    assert pool.get_cached_block(hashes[0]) is not None
    assert [pool.get_cached_block(h) for h in hashes[1:4]] == [None, None, None]
    assert not rig.busy()
    assert_no_leaks(rig.scheduler)


# -- async load failure -------------------------------------------------------------


def test_async_failure_waits_for_the_load_then_schedules_from_the_failed_block() -> None:
    rig = async_failure("recompute", async_delay_steps=2)
    r = rig.requests["r"]

    rig.step()  # admitted: 80 tokens to load, nothing to compute yet
    assert _scheduled(rig) == []
    (load,) = rig.last_out.loads
    assert (load.mode, load.first_index, len(load.block_ids)) == ("async", 0, 5)
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert r.num_computed_tokens == 80

    rig.step()  # transfer still in flight
    assert _scheduled(rig) == []
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert r.num_computed_tokens == 80

    rig.step()  # transfer reports finished, block #2 failed
    assert rig.last_result.finished_recving == {"r"}
    assert rig.last_result.invalid_block_ids == {load.block_ids[2]}
    assert _scheduled(rig) == []
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert r.num_computed_tokens == 32

    rig.step()
    assert _scheduled(rig) == [("r", 32, 96 - 32)]
    assert r.status is RequestStatus.RUNNING
    # The valid prefix was cached on landing; the failed block is cached again
    # only by the recompute.
    pool = rig.scheduler.pool
    assert pool.get_cached_block(block_hashes(ASYNC_PROMPT)[0]) is not None

    rig.run()
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert_no_leaks(rig.scheduler)


def test_async_failure_under_fail_finishes_with_error_when_the_load_reports() -> None:
    rig = async_failure("fail", async_delay_steps=1)
    r = rig.requests["r"]
    rig.step()
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV
    rig.step()
    assert r.status is RequestStatus.FINISHED_ERROR
    assert rig.trace[-1].finished == ("r",)
    # Async blocks are cached only when a load lands: nothing of it is cached.
    pool = rig.scheduler.pool
    assert [pool.get_cached_block(h) for h in block_hashes(ASYNC_PROMPT)] == [None] * 6
    assert not rig.busy()
    assert_no_leaks(rig.scheduler)


# -- a failed block shared by two running requests -------------------------------------


def test_shared_failed_block_is_recomputed_by_its_owner_only() -> None:
    rig = shared_failed_block("recompute")
    a, b = rig.requests["a"], rig.requests["b"]

    rig.step()
    assert _scheduled(rig) == [("a", 48, 16), ("b", 48, 16)]
    blocks = dict(rig.trace[-1].block_ids)
    assert blocks["a"][:3] == blocks["b"][:3]  # b hit a's blocks in the local cache
    assert rig.last_result.invalid_block_ids == {blocks["a"][1]}
    # a owns the failed block and truncates to it; b falls back to its pre-step count.
    assert a.num_computed_tokens == 16
    assert b.num_computed_tokens == 48
    assert a.output_token_ids == [] and b.output_token_ids == []

    rig.step()
    assert _scheduled(rig) == [("a", 16, 48), ("b", 48, 16)]

    rig.run()
    assert a.status is b.status is RequestStatus.FINISHED_LENGTH
    assert_no_leaks(rig.scheduler)


def test_shared_failed_block_under_fail_ends_both_requests_with_error() -> None:
    rig = shared_failed_block("fail")
    rig.step()
    assert {r.status for r in rig.requests.values()} == {RequestStatus.FINISHED_ERROR}
    # The owner's blocks from the failed one on are evicted.
    pool = rig.scheduler.pool
    hashes = block_hashes(SHARED_A)
    assert pool.get_cached_block(hashes[0]) is not None
    assert [pool.get_cached_block(h) for h in hashes[1:4]] == [None, None, None]
    assert_no_leaks(rig.scheduler)


def test_async_load_refused_for_a_reservation_does_not_block_the_loads_behind_it() -> None:
    # 3 usable blocks of 4 tokens. a (5 tokens) and b (9) both load their first block
    # asynchronously; a's load fails entirely, so a gives its block back and asks again.
    # Admitting a's new load would eat the 2 blocks reserved for b, whose load has
    # landed behind a in the queue: a must wait without stopping b (the engine used to
    # stall here forever).
    head = token_range(0, 4)
    config = SchedulerConfig(block_size=4, num_gpu_blocks=4, max_num_batched_tokens=4,
                             enable_prefix_caching=False, reserve_full_prompt=False)
    rig = build_rig(config, load_mode="async", faults=fail_block(0, "a", step=1),
                    async_delay_steps=0)
    preload(rig.store, block_hashes(head, 4)[:1])
    rig.add(make_request("a", head + [100], 1), make_request("b", head + token_range(200, 5), 1))

    rig.step()
    assert rig.last_result.invalid_block_ids == {rig.last_out.loads[0].block_ids[0]}
    rig.step()
    assert _scheduled(rig) == [("b", 4, 4)]
    assert rig.requests["a"].status is RequestStatus.WAITING
    assert rig.run(max_steps=10) == 3
    assert {r.status for r in rig.requests.values()} == {RequestStatus.FINISHED_LENGTH}
    assert_no_leaks(rig.scheduler)


# -- preemption -------------------------------------------------------------------------


def test_preemption_after_partial_hit_preempts_the_latest_and_readmits_as_repeat() -> None:
    rig = preemption_after_partial_hit()
    a, b = rig.requests["a"], rig.requests["b"]
    rig.scheduler.drain_events()

    rig.step()  # a computes its 32 tokens; b has a 32-token local hit and computes 16
    assert _scheduled(rig) == [("a", 0, 32), ("b", 32, 16)]
    assert rig.scheduler.pool.num_free_blocks == 0
    rig.scheduler.drain_events()

    rig.step()  # a's first decode needs a third block: b is the most recent, preempted
    assert rig.trace[-1].preempted == ("b",)
    assert _scheduled(rig) == [("a", 32, 1)]
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert rig.scheduler.waiting[0] is b
    assert rig.scheduler.running == [a]
    assert [i.spec for i in _increments(rig) if i.request_id == "b"] == [cat.PREEMPTIONS]

    while b.status is not RequestStatus.RUNNING:
        rig.step()
    assert a.status is RequestStatus.FINISHED_LENGTH  # b could come back only then
    # b re-admitted: 49 tokens known (48 prompt + 1 output), 32 found again locally.
    assert _scheduled(rig) == [("b", 32, 17)]
    incs = [(i.spec.name, i.label_values, i.amount) for i in _increments(rig)
            if i.request_id == "b"]
    assert incs == [
        (cat.PREFIX_CACHE_QUERY_TOKENS.name, ("local", "repeat"), 49),
        (cat.PREFIX_CACHE_HIT_TOKENS.name, ("local", "repeat"), 32),
        # tokens 32..48 had been computed before the preemption
        (cat.RECOMPUTED_TOKENS.name, ("preemption",), 16),
    ]
    rig.run()
    assert b.status is RequestStatus.FINISHED_LENGTH
    assert len(b.output_token_ids) == 3
    assert b.prompt.tokens(0, len(PREEMPT_B)) == PREEMPT_B
    assert_no_leaks(rig.scheduler)


# -- historical accounting ----------------------------------------------------------------


def _prompt_token_increments(rig: Rig, request_id: str) -> dict[str, float]:
    return {i.label_values[0]: i.amount for events in rig.scheduler.drain_events()
            for i in events.increments
            if i.spec is cat.PROMPT_TOKENS and i.request_id == request_id}


def _run_to_first_output(rig: Rig, request_id: str) -> dict[str, float]:
    x = rig.requests[request_id]
    found: dict[str, float] = {}
    while not x.output_token_ids:
        rig.step()
        found.update(_prompt_token_increments(rig, request_id))
    return found


def test_historical_accounting_goes_negative_after_preemption_then_larger_external_hit(
) -> None:
    """Named scenario: preemption before the first output followed by a larger external hit."""
    rig = preemption_before_first_output("historical")
    x = rig.requests["x"]

    rig.step()
    assert _scheduled(rig) == [("a", 0, 16), ("x", 0, 16)]
    assert x.num_cached_tokens == 0  # set once, at the first schedule
    rig.step()
    assert rig.trace[-1].preempted == ("x",)
    assert x.output_token_ids == []

    found = _run_to_first_output(rig, "x")
    assert x.num_external_computed_tokens == 16  # overwritten by the re-admission lookup
    assert any(ld[0] == "x" and ld[1] == "sync" for rec in rig.trace for ld in rec.loads)
    # compute = 64 - 0, external = 16, local_cache = 0 + 0 - 16
    assert found == {"compute": 64, "external": 16, "local_cache": -16}


def test_unified_accounting_records_the_same_scenario_once_and_never_negative() -> None:
    rig = preemption_before_first_output("unified")
    rig.step()
    first = _prompt_token_increments(rig, "x")
    found = first | _run_to_first_output(rig, "x")
    # Recorded at the first admission only: nothing had been cached anywhere then.
    assert first == {"compute": 64}
    assert found == {"compute": 64}
    rig.run()
    assert_no_leaks(rig.scheduler)
