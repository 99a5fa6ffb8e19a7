"""``async-load-stall`` at realistic sizes, on vLLM's real scheduler in-process.

vLLM admits an async load only if its blocks fit beside the reservation of every
prefill in flight (``scheduler.py:1427``); after a total failure the request is
still one of those prefills, so its own remaining blocks (all of its prompt's:
it holds none) are reserved against itself. Reading that code by hand gives the
rule these tests hold vLLM to: alone on the cache, the request is admitted again
iff ``usable >= need + offered`` (its reservation plus the blocks of the async load
it asks for), which is about twice its size when a store offers nearly its whole
prompt. Below that it is refused at every step, and with nothing else running, for
good. The protective mode (KVMETRICS_RECOVERY=evict) admits it at any size.
"""

from __future__ import annotations

import logging

import pytest

from kvmetrics.lab.vllm import canaries
from kvmetrics.lab.vllm.canary_bench import PROTECTED
from kvmetrics.lab.vllm.stall_regime import retry

pytestmark = pytest.mark.vllm


def admitted_by_hand(usable: int, prompt_tokens: int, offered_tokens: int) -> bool:
    need = -(-prompt_tokens // 16)
    return usable >= need + -(-offered_tokens // 16)


CASES = [
    # (usable blocks, prompt tokens, offered tokens)
    (6, 64, 48), (7, 64, 48),            # the canary's size, and one block more
    (4, 64, 16), (5, 64, 16),            # a short store hit: about need + 1
    (64, 64, 48), (64, 512, 496),        # the review's "64 free": admitted at once
    (40, 512, 496),                      # the review's "40 free and 32 needed": stuck
    (2046, 16384, 16368), (2047, 16384, 16368),   # the boundary at 2047 blocks
    (1535, 16384, 8192), (1536, 16384, 8192),     # half the prompt offered
]


@pytest.fixture(autouse=True)
def _quiet_vllm():
    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # vLLM logs every recovery these cases cause
    yield
    logger.setLevel(level)


@pytest.mark.parametrize(("usable", "tokens", "offered"), CASES)
def test_a_retried_async_load_is_admitted_iff_the_cache_holds_it_twice(
        usable: int, tokens: int, offered: int) -> None:
    found = retry(usable, tokens, offered)
    if admitted_by_hand(usable, tokens, offered):
        assert found.admitted_after == 1, found  # at the first step after the failure
    else:
        assert found.admitted_after is None, found


def test_a_long_context_request_over_half_the_cache_is_stuck_for_good() -> None:
    """A 32k-token cache (2048 blocks of 16) and a 20,000-token prompt a store offers
    again in full: refused at every step, while the whole cache is free; the same
    prompt at 12,000 tokens comes back at once; the protective mode admits both."""
    stuck = retry(2048, 20_000, steps=8)
    assert stuck.need == 1250 and stuck.admitted_after is None
    assert retry(2048, 12_000).admitted_after == 1
    with canaries.on_target(PROTECTED):
        # One step in the plain waiting queue (it holds no block), then admitted.
        assert retry(2048, 20_000).admitted_after == 2
