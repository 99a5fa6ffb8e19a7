"""When ``async-load-stall`` is permanent: the retried request's size against the cache.

The canary shows the mechanism on 6 usable blocks. Whether it matters depends on
sizes: after an async load fails in every block, the request is looked up again
with its own remaining blocks still counted in the reservation an async load must
leave free, so it is admitted only if ``free >= 2 x need`` (its own reservation
plus the blocks it asks for). :func:`retry` replays that on the installed vLLM's
real scheduler at any size, so the rule can be checked against vLLM rather than
taken from this docstring (``tests/test_vllm_stall_regime.py`` sweeps it, with a
long-context request over half the cache). Nothing else runs, so a refusal here is
for good: no running request will ever free a block.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmetrics.lab.vllm import canaries


@dataclass(frozen=True)
class Retry:
    usable_blocks: int
    prompt_tokens: int
    #: Blocks the request needs for its prompt.
    need: int
    #: Blocks of the async load the connector offers again.
    offered_blocks: int
    #: Steps after the failure until it was admitted again; None if never in ``steps``.
    admitted_after: int | None


def retry(usable_blocks: int, prompt_tokens: int, offered_tokens: int | None = None, *,
          steps: int = 4) -> Retry:
    """A request alone on a cache of ``usable_blocks`` loads ``offered_tokens`` (by
    default all its full blocks but the last token's) asynchronously; the transfer
    reports finished with its first block failed."""
    bs = canaries.BLOCK
    b = canaries.bench("recompute", num_gpu_blocks=usable_blocks + 1,  # + vLLM's null block
                       max_model_len=prompt_tokens + 64,
                       max_num_batched_tokens=max(256, prompt_tokens))
    offered = (prompt_tokens - 1) // bs * bs if offered_tokens is None else offered_tokens
    r = b.add("r", canaries.prompt(1_000, prompt_tokens), offer=offered, load_async=True)
    out = b.sched.schedule()
    canaries.expect(r.status == canaries.request_status("WAITING_FOR_REMOTE_KVS"),
                    "r waits for its async load")
    b.update(b.execute(out), invalid={b.blocks("r")[0]}, finished_recving={"r"})
    need = -(-prompt_tokens // bs)
    found = Retry(usable_blocks, prompt_tokens, need, -(-offered // bs), None)
    waiting = canaries.request_status("WAITING")
    for step in range(1, steps + 1):
        out = b.sched.schedule()
        if r.status != waiting:
            return Retry(**{**found.__dict__, "admitted_after": step})
        # Refused while it holds nothing and nothing else runs: every block is free.
        pool = b.sched.kv_cache_manager.block_pool
        canaries.expect(pool.get_num_free_blocks() == usable_blocks and not b.sched.running,
                        "the whole cache is free while r is refused")
        b.update(b.execute(out))
    return found
