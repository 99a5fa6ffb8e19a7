"""``async-load-stall`` tried in a real ``vllm serve`` with LMCache's real async loads:
LMCache 0.5.6 does not trigger it.

LMCache 0.5.6 multi-process mode (CPU L1) behind ``FaultInjectingLMCacheMPConnector``,
policy ``recompute``, a 12-block cache (384 tokens) and one long prompt of 300
tokens (10 blocks, over half of the cache: the stall's regime, docs/vllm-defects.md):

1. the prompt runs once, fault-free: its baseline; LMCache stores its KV; the prefix
   cache is reset;
2. the same prompt again: LMCache offers 288 tokens (9 blocks) as an async load
   (load #1), whose block #0 fails, so vLLM frees all the request's blocks. The stall
   needs the connector to offer the same load again (then need + offered = 19 > 12
   blocks, refused every step). LMCache 0.5.6 does not: its connector "bypasses
   LMCache" for a request whose async load failed and offers nothing, so the request
   is recomputed at once and answers the baseline's tokens, on stock vLLM.

So LMCache multi-process mode is not a connector that exposes the stall (its
``get_num_new_matched_tokens`` fails closed on purpose); the day it offers the load
again, this test fails and the stall must be shown here instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.serve_requests import greedy_prompts, output_tokens
from benchmarks.vllm_server import BLOCK_SIZE, RECOVERED, ServerSpec, VllmServer
from tests.helpers.lmcache_server import LMCacheServer, lmcache_transfer

pytestmark = pytest.mark.serve

MAX_TOKENS = 8
LONG = greedy_prompts(1, seed=31, lengths=(300,))[0]
INJECTED = re.compile(r"failing load #(\d+) of request (\S+) \((sync|async|emulated)\)")
BYPASSED = re.compile(r"Bypassing LMCache for request (\S+) after a failed async KV load")


@pytest.fixture(scope="module")
def found(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work: Path = tmp_path_factory.mktemp("serve-stall")
    with LMCacheServer(work) as cache:
        # 13 = vLLM's null block + 12 usable.
        spec = ServerSpec(kv_transfer=lmcache_transfer(cache, "recompute", fault_loads=[1],
                                                       fault_block=0),
                          num_gpu_blocks=13, max_model_len=320)
        with VllmServer(spec, work, "stall") as server:
            clean = server.complete(LONG, MAX_TOKENS)
            assert clean[0] == 200, clean
            server.reset_prefix_cache()
            retried = server.complete(LONG, MAX_TOKENS, timeout=60)
            return {"clean": output_tokens(clean[1]), "retried": retried,
                    "log": server.log()}


def test_the_long_requests_async_load_fails_in_its_first_block(found: dict) -> None:
    loads = INJECTED.findall(found["log"])
    assert [(n, mode) for n, _, mode in loads] == [("1", "async")]
    # vLLM rolled back the whole load: 9 blocks of 32 tokens.
    assert RECOVERED.findall(found["log"]) == [("1", str(9 * BLOCK_SIZE))]


def test_lmcache_offers_nothing_again_so_the_request_is_recomputed(found: dict) -> None:
    (_, request_id, _), = INJECTED.findall(found["log"])
    assert BYPASSED.findall(found["log"]) == [request_id]
    status, body = found["retried"]
    assert status == 200, body
    assert output_tokens(body) == found["clean"]
