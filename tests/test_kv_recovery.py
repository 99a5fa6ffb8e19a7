"""The verifier against broken and real recovery paths.

Each scenario is built by hand so that a request really reads the block in
question: the store is pre-populated with a shared prefix, a scripted fault
fails one block of one request's load, and later requests reuse that prefix.
Deliberately broken recoveries must be caught naming the right request and
block; the findings about the real (vLLM-shaped) recovery path are reproduced
here deterministically, and shown to disappear with the fix they point to.
"""

from __future__ import annotations

import random

import pytest

import kvmetrics.lab.engine.request as request_module
import kvmetrics.lab.engine.update as update_module
from kvmetrics.lab.engine.block_pool import BlockPool
from kvmetrics.lab.engine.faults import FaultPlan, ScriptedFailure
from kvmetrics.lab.kv.device import available_devices
from kvmetrics.lab.kv.harness import Engine, Job, build_engine, drive, populate_store
from kvmetrics.lab.kv.verify import KVVerificationError
from kvmetrics.lab.kv_errors import is_verification_error

DEVICES = available_devices()
BS = 4

_rng = random.Random(2024)


def _tokens(n: int) -> tuple[int, ...]:
    return tuple(_rng.randrange(50_000) for _ in range(n))


PREFIX = _tokens(4 * BS)  # four full blocks, stored externally by the seed request
SEED_PROMPT = PREFIX + _tokens(BS)
A_PROMPT = PREFIX + _tokens(6)  # the loader: its load of block #1 fails
S_PROMPT = PREFIX + _tokens(5)  # shares the prefix, and its suffix fills block #4
OTHER = _tokens(7)


def _engine(policy: str, device: str, fail_block: int = 1, **kw) -> Engine:
    faults = FaultPlan(scripted=(ScriptedFailure(fail_block, "A"),))
    engine = build_engine(policy=policy, faults=faults, block_size=BS, device=device, **kw)
    populate_store(engine, SEED_PROMPT)
    return engine


def _admit(engine: Engine, *jobs: Job) -> None:
    for job in jobs:
        engine.scheduler.add_request(job.request())


def _failed_block(engine: Engine) -> int:
    """Run the step in which A loads its prefix; return the id of A's failed block #1."""
    out = engine.loop.step()
    (load,) = [ld for ld in out.loads if ld.request_id == "A"]
    assert load.mode == "sync" and load.first_index == 0
    return load.block_ids[1]


# -- deliberately broken recoveries --------------------------------------------------------


def _no_truncation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break the rollback: affected requests fall back to their pre-step count instead of
    being truncated to their first failed block (num_computed_tokens not truncated)."""
    original = update_module.handle_invalid_blocks

    def broken(sched, invalid, num_scheduled, events):
        before = {r.request_id: r.num_computed_tokens - num_scheduled.get(r.request_id, 0)
                  for r in sched.running}
        affected = original(sched, invalid, num_scheduled, events)
        for r in sched.running:
            if r.request_id in affected:
                r.num_computed_tokens = before[r.request_id]
        return affected

    monkeypatch.setattr(update_module, "handle_invalid_blocks", broken)


@pytest.mark.parametrize("device", DEVICES)
def test_skipped_rollback_is_caught(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    _no_truncation(monkeypatch)
    engine = _engine("recompute", device)
    _admit(engine, Job("A", A_PROMPT, 3))
    bad = _failed_block(engine)
    assert engine.runner.findings == []  # the failed step itself is discarded, not a finding
    drive(engine, [])
    first = engine.runner.findings[0]
    assert (first.request_id, first.block_id, first.block_index) == ("A", bad, 1)
    assert (first.token_start, first.token_end) == (BS, 2 * BS)
    assert engine.runner.stats.discarded_reads == 1


@pytest.mark.parametrize("device", DEVICES)
def test_skipped_rollback_raises_in_strict_mode(monkeypatch: pytest.MonkeyPatch,
                                                device: str) -> None:
    _no_truncation(monkeypatch)
    engine = _engine("recompute", device, strict=True)
    _admit(engine, Job("A", A_PROMPT, 3))
    bad = _failed_block(engine)
    with pytest.raises(KVVerificationError) as info:
        engine.loop.step()
    assert is_verification_error(info.value)
    assert (info.value.findings[0].request_id, info.value.findings[0].block_id) == ("A", bad)
    assert "request 'A'" in str(info.value)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("evict", [True, False], ids=["correct", "no-eviction"])
def test_fail_policy_must_evict_failed_blocks(monkeypatch: pytest.MonkeyPatch, device: str,
                                              evict: bool) -> None:
    if not evict:
        monkeypatch.setattr(BlockPool, "evict_blocks", lambda self, block_ids: 0)
    engine = _engine("fail", device)
    _admit(engine, Job("A", A_PROMPT, 3))
    bad = _failed_block(engine)
    assert engine.scheduler.requests.get("A") is None  # finished with an error, blocks freed
    drive(engine, [Job("C", S_PROMPT, 3)])
    if evict:
        assert engine.runner.findings == []
        return
    # C hit A's failed block, still hashed, in the prefix cache.
    first = engine.runner.findings[0]
    assert (first.request_id, first.block_id, first.block_index) == ("C", bad, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_engine_hash_bug_cannot_hide(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """A block hash that ignores most of a block's tokens makes a request hit another
    prefix's blocks. Ground truth comes from token ids, never from those hashes."""
    real = request_module.hash_block
    monkeypatch.setattr(request_module, "hash_block",
                        lambda parent, key, extra=b"": real(parent, key[:9], extra))
    engine = build_engine(block_size=BS, device=device, store_blocks=0)
    x = (1, 2, 3, 4, 5, 6, 7, 8, 9)
    y = (1, 9, 9, 9, 5, 9, 9, 9, 9)  # same first token in each block, different blocks
    drive(engine, [Job("X", x, 2), Job("Y", y, 2, arrival=3)])
    assert {(f.request_id, f.block_index) for f in engine.runner.findings} >= {("Y", 0)}


# -- findings about the real recovery path -------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fixed", [False, True], ids=["vllm-recovery", "evicting-recovery"])
def test_recompute_policy_stale_shared_block(device: str, fixed: bool) -> None:
    """Under ``recompute`` a failed sync block stays hashed until its owner recomputes
    it. If the owner goes away first (here: aborted), the next request with the same
    prefix hits the failed block and attends over poisoned KV."""
    engine = _engine("recompute", device, recovery="evict" if fixed else "vllm")
    _admit(engine, Job("A", A_PROMPT, 3))
    bad = _failed_block(engine)
    assert engine.scheduler.requests["A"].num_computed_tokens == BS  # rolled back to #1
    assert engine.scheduler.abort("A")
    drive(engine, [Job("C", S_PROMPT, 3)])
    if fixed:
        assert engine.runner.findings == []
        return
    first = engine.runner.findings[0]
    assert (first.request_id, first.block_id, first.block_index) == ("C", bad, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fixed", [False, True], ids=["vllm-recovery", "evicting-recovery"])
def test_recompute_policy_preempted_owner_reads_stale_block(device: str, fixed: bool) -> None:
    """The same hole without any abort: the owner is preempted before it recomputes
    its failed block, and on re-admission hits that block in the prefix cache."""
    # 1 null block + 2 for R + 6 for A: the pool is full once A is admitted.
    engine = _engine("recompute", device, num_gpu_blocks=9,
                     recovery="evict" if fixed else "vllm")
    _admit(engine, Job("R", OTHER, 8))
    engine.loop.step()  # R prefills 7 tokens
    _admit(engine, Job("A", A_PROMPT, 3))
    bad = _failed_block(engine)  # R decodes into its 2nd block; A loads, block #1 fails
    out = engine.loop.step()  # R needs a 3rd block: A, last in, is preempted
    assert out.preempted_req_ids == {"A"}
    drive(engine, [])
    if fixed:
        assert engine.runner.findings == []
        return
    first = engine.runner.findings[0]
    assert (first.request_id, first.block_id, first.block_index) == ("A", bad, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["owner-only-saves", "discard-aware-saves", "no-taint"])
def test_sharer_saves_poisoned_kv_to_store(device: str, variant: str) -> None:
    """S hits A's blocks in the step where A's load of one of them fails. S's output
    is discarded; with the old owner-only save rule the block S computed in that step
    (over poisoned KV) is still saved to the store. T, with S's prompt, later loads it
    from the store (policy ``fail``: the evicted prefix sends T to the store). The
    default discard-aware rule (both runners) saves nothing of S's."""
    options = {"owner-only-saves": {"save_policy": "owner-only"},
               "no-taint": {"taint_discarded": False}}.get(variant, {})
    engine = _engine("fail", device, **options)
    _admit(engine, Job("A", A_PROMPT, 3), Job("S", S_PROMPT, 3))
    out = engine.loop.step()
    assert any(s.request_id == "S" and s.block_index == 4 for s in out.saves)
    assert engine.runner.stats.discarded_reads == 2  # A and S both read the failed block
    drive(engine, [])
    assert engine.runner.findings == []  # nobody kept an output over bad KV so far
    drive(engine, [Job("T", S_PROMPT, 3)])
    if variant != "owner-only-saves":
        assert engine.runner.findings == []
        return
    first = engine.runner.findings[0]
    assert (first.request_id, first.block_index) == ("T", 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fixed", [False, True], ids=["vllm-recovery", "evicting-recovery"])
def test_sharer_tail_stays_hashed_after_fail(device: str, fixed: bool) -> None:
    """Under ``fail`` only the owner's blocks from the failed one on are evicted. A
    same-step sharer's own new block (computed over poisoned KV) stays hashed behind
    the evicted block; once another request re-caches the evicted block's hash (it
    loads it again, successfully), the stale block is reachable again."""
    engine = _engine("fail", device, save_policy="discard-aware",
                     recovery="evict" if fixed else "vllm")
    _admit(engine, Job("A", A_PROMPT, 3), Job("S", S_PROMPT, 3))
    out = engine.loop.step()
    (s_block,) = [s.block_ids[4] for s in out.scheduled if s.request_id == "S"]
    drive(engine, [])
    drive(engine, [Job("U", PREFIX + _tokens(3), 2)])  # reloads blocks #1-#3 of the prefix
    assert engine.runner.findings == []
    drive(engine, [Job("T", S_PROMPT, 3)])
    if fixed:
        assert engine.runner.findings == []
        return
    first = engine.runner.findings[0]
    assert (first.request_id, first.block_id, first.block_index) == ("T", s_block, 4)
