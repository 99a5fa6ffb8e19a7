"""Named KV-path scenarios with known numbers, shared by engine and metrics tests.

Block size 16 throughout. Each builder returns a rig with the requests added and
nothing run yet, so a test can step it and look in between.
"""

from __future__ import annotations

from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.metrics.pipeline import MetricsPipeline
from tests.helpers.engine import (
    BLOCK,
    Rig,
    block_hashes,
    build_rig,
    fail_block,
    make_request,
    preload,
)
from tests.helpers.engine import tokens as token_range

#: A 64-token prompt; the store holds its first 3 blocks (48 tokens).
SYNC_PROMPT = token_range(1_000, 64)
#: A 96-token prompt; the store holds its first 5 blocks (80 tokens).
ASYNC_PROMPT = token_range(5_000, 96)


def sync_failure(policy: str, pipeline: MetricsPipeline | None = None,
                 max_tokens: int = 4) -> Rig:
    """Request ``r`` loads 48 tokens synchronously; the load of its block #1 fails."""
    rig = build_rig(SchedulerConfig(block_size=BLOCK, num_gpu_blocks=32,
                                    kv_load_failure_policy=policy),
                    load_mode="sync", faults=fail_block(1, "r"), pipeline=pipeline)
    preload(rig.store, block_hashes(SYNC_PROMPT)[:3])
    rig.add(make_request("r", SYNC_PROMPT, max_tokens))
    return rig


def async_failure(policy: str, pipeline: MetricsPipeline | None = None,
                  async_delay_steps: int = 2, max_tokens: int = 2) -> Rig:
    """Request ``r`` loads 80 tokens asynchronously; the load of its block #2 fails."""
    rig = build_rig(SchedulerConfig(block_size=BLOCK, num_gpu_blocks=32,
                                    kv_load_failure_policy=policy),
                    load_mode="async", faults=fail_block(2, "r"),
                    async_delay_steps=async_delay_steps, pipeline=pipeline)
    preload(rig.store, block_hashes(ASYNC_PROMPT)[:5])
    rig.add(make_request("r", ASYNC_PROMPT, max_tokens))
    return rig


#: ``a`` and ``b`` share their first 48 tokens; each has a 16-token tail of its own.
SHARED_HEAD = token_range(9_000, 48)
SHARED_A = SHARED_HEAD + token_range(9_100, 16)
SHARED_B = SHARED_HEAD + token_range(9_200, 16)


def shared_failed_block(policy: str = "recompute",
                        pipeline: MetricsPipeline | None = None) -> Rig:
    """``a`` loads the shared head from the store (block #1 fails); ``b``, admitted in the
    same step, hits ``a``'s freshly allocated blocks in the local prefix cache."""
    rig = build_rig(SchedulerConfig(block_size=BLOCK, num_gpu_blocks=32,
                                    kv_load_failure_policy=policy),
                    load_mode="sync", faults=fail_block(1, "a"), pipeline=pipeline)
    preload(rig.store, block_hashes(SHARED_A)[:3])
    rig.add(make_request("a", SHARED_A, 3), make_request("b", SHARED_B, 3))
    return rig


#: ``w`` warms the prefix cache with the 32-token head that ``b`` shares.
WARM_HEAD = token_range(20_000, 32)
WARM = WARM_HEAD + token_range(20_100, 8)
PREEMPT_A = token_range(21_000, 32)
PREEMPT_B = WARM_HEAD + token_range(22_000, 16)


def preemption_after_partial_hit(pipeline: MetricsPipeline | None = None) -> Rig:
    """Five usable blocks. After ``w`` ran, ``a`` (2 blocks) and ``b`` (a 32-token local
    hit on ``w``'s blocks plus one new block) fill the cache; ``a``'s first decode needs a
    third block, so ``b``, the most recently admitted, is preempted. No connector."""
    rig = build_rig(SchedulerConfig(block_size=BLOCK, num_gpu_blocks=6,
                                    max_num_batched_tokens=256),
                    connector=False, pipeline=pipeline)
    rig.add(make_request("w", WARM, 1))
    rig.run()
    rig.add(make_request("a", PREEMPT_A, 8), make_request("b", PREEMPT_B, 3))
    return rig


#: Scenario "preemption before the first output followed by a larger external hit".
HIST_A = token_range(30_000, 16)
HIST_X = token_range(31_000, 64)


def preemption_before_first_output(accounting: str,
                                   pipeline: MetricsPipeline | None = None) -> Rig:
    """``x`` (64 tokens, nothing cached anywhere) is chunk-prefilled 16 tokens, then
    preempts itself before its first output when ``a``'s decode takes the last free
    block. While ``x`` waits, ``a`` grows over ``x``'s freed block, evicting it from the
    local cache; the store kept it (the runner saved it). On re-admission the
    connector offers 16 tokens where the first admission found none.

    Historical accounting: ``num_cached_tokens`` was set to 0 at the first schedule,
    ``num_external_computed_tokens`` is overwritten with 16 by the new lookup, so at
    the first output local_cache = 0 + 0 - 16 = -16.

    ``x`` is admitted although its whole prompt does not fit next to ``a``: the
    admission of the vLLM versions that had this accounting, before
    ``scheduler_reserve_full_isl`` (so that gate is off here).
    """
    rig = build_rig(SchedulerConfig(block_size=BLOCK, num_gpu_blocks=5,
                                    max_num_batched_tokens=32, accounting=accounting,
                                    reserve_full_prompt=False),
                    load_mode="sync", pipeline=pipeline)
    rig.add(make_request("a", HIST_A, 40), make_request("x", HIST_X, 1))
    return rig
