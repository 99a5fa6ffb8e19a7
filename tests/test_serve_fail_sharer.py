"""``fail-sharer-blocks-hashed`` as wrong tokens in a real ``vllm serve``.

Policy ``fail`` (vLLM's default), FaultInjectingConnector around
tests/helpers/load_only_connector.py (ExampleConnector, sync loads, that does not
save the sharer's prompt; see there why), lockstep scheduling:

1. ``a`` (100 tokens) and ``s`` (``a``'s first 64 tokens, then 36 of its own) run
   alone, fault-free: their baselines. The store then holds ``a``; the prefix cache
   is reset after each.
2. ``a`` and ``s`` are released into one step. ``a`` loads 96 tokens (load #1: its
   block #1, tokens 32-63, fails and is poisoned); ``s`` hits ``a``'s blocks #0 and
   #1 and computes its block #2 over the poisoned block. vLLM fails both requests,
   as policy ``fail`` says, and evicts ``a``'s blocks from #1 on, but not ``s``'s #2.
3. The clients retry. ``a``'s retry loads its blocks again (load #2, clean), which
   puts block #1's hash back into the prefix cache; ``s``'s retry then chains
   through it into the stale block #2: a 96-token local hit and tokens that differ
   from the baseline. Under the protective mode (``KVMETRICS_RECOVERY=evict``) the
   block left with the others: a 64-token hit and the baseline's tokens.

Oracles: the baselines, vLLM's "Failing N request(s)" log line (the sharer was
failed with the owner) and vLLM's own ``vllm:prefix_cache_hits_total``.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.load_only_connector import LOAD_ONLY_MARK
from tests.helpers.vllm_server import (
    BLOCK_SIZE,
    ServerSpec,
    VllmServer,
    greedy_prompts,
    output_tokens,
    total,
)

MAX_TOKENS = 8
OWNER = greedy_prompts(1, seed=23, lengths=(100,))[0]
SHARER = OWNER[:2 * BLOCK_SIZE] + [LOAD_ONLY_MARK] + greedy_prompts(1, seed=24, lengths=(35,))[0]
INJECTED = re.compile(r"failing load #(\d+) of request (\S+) \(sync\)")
VLLM_FAILED = re.compile(r"Failing (\d+) request\(s\) due to KV load failure")


def fail_sharer_server(work, env: dict[str, str]) -> VllmServer:
    kv_transfer = {
        "kv_connector": "FaultInjectingConnector",
        "kv_connector_module_path": "kvmetrics.integrations.vllm.faults",
        "kv_role": "kv_both", "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "inner_connector": "LoadOnlyExampleConnector",
            "inner_module_path": "tests.helpers.load_only_connector",
            "inner_extra_config": {"shared_storage_path": str(work / "kv")},
            "fault_loads": [1], "fault_block": 1},
    }
    spec = ServerSpec(kv_transfer=kv_transfer, num_gpu_blocks=64, max_model_len=320,
                      extra_args=["--max-num-batched-tokens", "512"], env=env)
    return VllmServer(spec, work)


@pytest.fixture(scope="module", params=["vllm", "evict"])
def found(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    mode = request.param
    work = tmp_path_factory.mktemp(f"serve-fail-sharer-{mode}")
    env = {"KVMETRICS_RECOVERY": mode} if mode == "evict" else {}
    with fail_sharer_server(work, env) as server:
        clean = {}
        for name, prompt in (("a", OWNER), ("s", SHARER)):
            status, body = server.complete(prompt, MAX_TOKENS)
            assert status == 200, body
            clean[name] = output_tokens(body)
            server.reset_prefix_cache()
        failing = server.complete_queued_together({"a": OWNER, "s": SHARER}, MAX_TOKENS)
        retried_a = server.complete(OWNER, MAX_TOKENS)
        before, _ = server.pages_when_finished(5)
        retried_s = server.complete(SHARER, MAX_TOKENS)
        after, _ = server.pages_when_finished(6)
        hits = (total(after, "vllm:prefix_cache_hits_total")
                - total(before, "vllm:prefix_cache_hits_total"))
        yield {"mode": mode, "clean": clean, "failing": failing,
               "retried": {"a": retried_a, "s": retried_s}, "sharer_hit": hits,
               "log": server.log()}


def errored(answer: tuple[int, dict]) -> bool:
    status, body = answer
    return status != 200 or body["choices"][0].get("finish_reason") not in ("length", "stop")


def test_policy_fail_ends_the_owner_and_its_sharer(found) -> None:
    assert [n for n, _ in INJECTED.findall(found["log"])] == ["1"]
    assert VLLM_FAILED.findall(found["log"]) == ["2"], "s did not share the failed block"
    assert errored(found["failing"]["a"]) and errored(found["failing"]["s"])


def test_the_owners_retry_loads_cleanly(found) -> None:
    status, body = found["retried"]["a"]
    assert status == 200, body
    assert output_tokens(body) == found["clean"]["a"]


def test_the_sharers_retry_finds_its_blocks_computed_over_the_failed_one(found) -> None:
    status, body = found["retried"]["s"]
    assert status == 200, body
    tokens = output_tokens(body)
    if found["mode"] == "vllm":
        assert tokens != found["clean"]["s"], "s's retry read its stale block"
        assert found["sharer_hit"] == 3 * BLOCK_SIZE  # #0, #1 (reloaded) and the stale #2
    else:
        assert tokens == found["clean"]["s"], "s's retry read a stale block under evict"
        assert found["sharer_hit"] == 2 * BLOCK_SIZE  # #2 left the prefix cache
