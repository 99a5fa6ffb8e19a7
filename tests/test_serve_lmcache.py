"""LMCache 0.5.6 (multi-process mode) in real ``vllm serve`` processes: loads are
async, as fleets run them, and kvmetrics counts them as vLLM does.

One ``lmcache server`` (CPU L1) serves three vLLM servers in turn, all on the same
model folder, so the KV one stored is found by the next:

1. **stock** ``LMCacheMPConnector``: round 1 computes the prompts (LMCache stores
   their KV), the prefix cache is reset, round 2 loads them. Oracles: vLLM's own
   ``/metrics`` (external hits and queries, prompt tokens by source; LMCache loads
   whole 32-token chunks = blocks, so blocks = hits / 32) and round 1's greedy
   outputs (the fault-free run).
2. ``FaultInjectingLMCacheMPConnector``, policy ``recompute``: every prompt loads
   from LMCache and a seeded share of the loads fail (one block poisoned when
   LMCache reports the async load finished). Oracles: outputs equal round 1; vLLM's
   "Recovered from KV load failure: N request(s) ... (M tokens affected)" lines give
   the failed requests and rolled-back tokens.
3. the same wrapper, policy ``fail``: **vLLM 0.32.0's EngineCore dies** at the first
   failed load. vLLM fails the request while it waits for its async load
   (``WAITING_FOR_REMOTE_KVS``); LMCache, which loads *and* stores for the request,
   returned ``delay_free=True`` from ``request_finished``; the load's
   ``finished_recving`` then frees the finished request, and LMCache's later
   ``finished_sending`` for it trips ``assert req_id in self.requests`` in
   ``Scheduler._update_from_kv_xfer_finished``. A real LMCache load failure takes
   the same path (the wrapper only chooses which load fails). The test pins that
   down exactly, so it fails (and must become "errored answers == kvmetrics' failed
   requests, server up") the day vLLM stops crashing.

Measured on the 2-core CI kind of machine: each vLLM server starts in 45-60 s;
the module takes about 4 minutes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.serve_requests import CONNECTOR_PROMPTS, errored, output_tokens
from benchmarks.vllm_server import BLOCK_SIZE, RECOVERED, ServerSpec, VllmServer, total, wait_until
from tests.helpers.lmcache_server import LMCacheServer, lmcache_transfer

pytestmark = pytest.mark.serve

PROMPTS = CONNECTOR_PROMPTS
MAX_TOKENS = 8
FAULTS = {"fault_rate": 0.4, "fault_seed": 2}
FAILING = re.compile(r"Failing (\d+) request\(s\) due to KV load failure")
INJECTED = re.compile(r"failing load #(\d+) of request (\S+) \((sync|async|emulated)\)")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-lmcache")


@pytest.fixture(scope="module")
def cache(work: Path):
    with LMCacheServer(work) as server:
        yield server


def complete_all(server: VllmServer) -> list[tuple[int, dict]]:
    return [server.complete(p, MAX_TOKENS) for p in PROMPTS]


def outputs(answers: list[tuple[int, dict]]) -> list[list[int]]:
    assert all(status == 200 for status, _ in answers), [a for a in answers if a[0] != 200]
    return [output_tokens(body) for _, body in answers]


@pytest.fixture(scope="module")
def stock(work: Path, cache: LMCacheServer) -> dict:
    spec = ServerSpec(kv_transfer=lmcache_transfer(cache))
    with VllmServer(spec, work, "stock") as server:
        first = outputs(complete_all(server))
        server.reset_prefix_cache()
        second = outputs(complete_all(server))
        theirs, ours = server.pages_when_finished(2 * len(PROMPTS))
        return {"first": first, "second": second, "vllm": theirs, "ours": ours,
                "log": server.log()}


@pytest.fixture(scope="module")
def recompute(work: Path, cache: LMCacheServer, stock: dict) -> dict:
    spec = ServerSpec(kv_transfer=lmcache_transfer(cache, "recompute", **FAULTS))
    with VllmServer(spec, work, "recompute") as server:
        answers = outputs(complete_all(server))
        theirs, ours = server.pages_when_finished(len(PROMPTS))
        return {"answers": answers, "vllm": theirs, "ours": ours, "log": server.log()}


@pytest.fixture(scope="module")
def fail(work: Path, cache: LMCacheServer, stock: dict) -> dict:
    spec = ServerSpec(kv_transfer=lmcache_transfer(cache, "fail", **FAULTS))
    with VllmServer(spec, work, "fail") as server:
        answers = []
        for prompt in PROMPTS:  # up to the first request a failed load hits
            answers.append(server.complete(prompt, MAX_TOKENS))
            if errored(answers[-1]):
                break
        process = server.process
        assert process is not None
        wait_until(lambda: process.poll() is not None, 120, "the server to exit")
        return {"answers": answers, "log": server.log()}


def test_stock_lmcache_hits_and_tokens_equal_vllms(stock: dict) -> None:
    assert stock["second"] == stock["first"]
    assert len({tuple(o) for o in stock["first"]}) == len(PROMPTS)  # outputs follow prompts
    ours, vllm = stock["ours"], stock["vllm"]
    hits = total(vllm, "vllm:external_prefix_cache_hits_total")
    assert hits > 0, "LMCache served nothing"
    assert total(ours, "kvmetrics_prefix_cache_hit_tokens_total", source="external") == hits
    assert total(ours, "kvmetrics_prefix_cache_query_tokens_total", source="external") == \
        total(vllm, "vllm:external_prefix_cache_queries_total")
    assert total(ours, "kvmetrics_prompt_tokens_total", source="external") == \
        total(vllm, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == hits
    assert total(ours, "kvmetrics_prompt_tokens_total") == \
        total(vllm, "vllm:prompt_tokens_by_source_total")
    assert total(ours, "kvmetrics_kv_load_blocks_total", mode="async") == hits / BLOCK_SIZE
    assert total(ours, "kvmetrics_kv_load_blocks_total", mode="sync") == 0  # all async
    assert total(ours, "kvmetrics_kv_load_failed_requests_total") == 0


def test_recompute_outputs_and_counts_equal_vllms_log(stock: dict, recompute: dict) -> None:
    assert recompute["answers"] == stock["first"]
    lines = RECOVERED.findall(recompute["log"])
    injected = INJECTED.findall(recompute["log"])
    assert lines and injected, "no load failed"
    ours = recompute["ours"]
    assert total(ours, "kvmetrics_kv_load_failed_requests_total", action="rescheduled",
                 policy="recompute", mode="async") == sum(int(n) for n, _ in lines) \
        == len(injected)
    assert total(ours, "kvmetrics_rolled_back_tokens_total") == sum(int(m) for _, m in lines)
    assert total(ours, "kvmetrics_kv_load_failed_requests_total", action="failed") == 0
    assert total(ours, "kvmetrics_prefix_cache_hit_tokens_total", source="external") == \
        total(recompute["vllm"], "vllm:external_prefix_cache_hits_total") > 0


def test_fail_policy_kills_vllm_032s_engine_at_the_first_failed_lmcache_load(
        stock: dict, fail: dict) -> None:
    answers, log = fail["answers"], fail["log"]
    assert errored(answers[-1]) and not any(errored(a) for a in answers[:-1])
    for before, (_, body) in zip(stock["first"], answers[:-1], strict=False):
        assert output_tokens(body) == before
    assert len(INJECTED.findall(log)) == 1
    assert [int(n) for n in FAILING.findall(log)] == [1]
    assert "EngineCore encountered a fatal error" in log
    crash = log[log.index("EngineCore encountered a fatal error"):]
    assert "_update_from_kv_xfer_finished" in crash and "assert req_id in self.requests" \
        in crash.split("AssertionError")[0]
