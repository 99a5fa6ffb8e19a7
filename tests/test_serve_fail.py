"""FaultInjectingConnector around ExampleConnector in a real ``vllm serve``, policy
``fail``: a request hit by a failed load gets an error, the server stays up, and
kvmetrics counts exactly the errors clients saw.

Same two rounds as tests/test_serve_recompute.py (prompts computed and saved, prefix
cache reset, the same prompts loaded with a seeded half of the loads failing, sync
and async). Oracles: the HTTP answers themselves (which requests errored), vLLM's
"Failing N request(s) due to KV load failure" log lines and its ``/metrics``.

The documented difference is asserted exactly: vLLM counts a request's prompt tokens
by source when its first output arrives, kvmetrics when it is admitted, so vLLM's
total is short by the prompts of the requests that policy ``fail`` ended before
their first output.

Measured on the 2-core CI kind of machine: the server starts in 45-60 s; the
module takes about 70 s.
"""

from __future__ import annotations

import re

import pytest

from benchmarks.serve_requests import (
    CONNECTOR_PROMPTS,
    connector_config,
    errored,
    loaded_tokens,
    output_tokens,
)
from benchmarks.vllm_server import ServerSpec, VllmServer, total

pytestmark = pytest.mark.serve

PROMPTS = CONNECTOR_PROMPTS

FAILING = re.compile(r"Failing (\d+) request\(s\) due to KV load failure")
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("serve-fail")
    with VllmServer(ServerSpec(kv_transfer=connector_config(work / "kv", "fail")), work) as s:
        yield s


@pytest.fixture(scope="module")
def rounds(server: VllmServer) -> dict:
    first = [server.complete(p, MAX_TOKENS) for p in PROMPTS]
    assert all(status == 200 for status, _ in first)
    server.reset_prefix_cache()
    second = [server.complete(p, MAX_TOKENS) for p in PROMPTS]
    theirs, ours = server.pages_when_finished(2 * len(PROMPTS))
    return {"first": first, "second": second, "vllm": theirs, "ours": ours,
            "log": server.log()}


def test_errored_requests_equal_kvmetrics_failed_requests(rounds: dict) -> None:
    failed = [a for a in rounds["second"] if errored(a)]
    assert 0 < len(failed) < len(PROMPTS), [a[0] for a in rounds["second"]]
    ours, vllm = rounds["ours"], rounds["vllm"]
    assert total(ours, "kvmetrics_kv_load_failed_requests_total", action="failed",
                 policy="fail") == len(failed)
    assert total(ours, "kvmetrics_kv_load_failed_requests_total", action="rescheduled") == 0
    assert sum(int(n) for n in FAILING.findall(rounds["log"])) == len(failed)
    assert total(ours, "kvmetrics_finished_requests_total", reason="error") == len(failed)
    assert total(vllm, "vllm:request_success_total", finished_reason="error") == len(failed)
    # Both ways of failing were exercised.
    assert total(ours, "kvmetrics_kv_load_failed_requests_total", mode="sync") > 0
    assert total(ours, "kvmetrics_kv_load_failed_requests_total", mode="async") > 0


def test_requests_that_loaded_cleanly_keep_the_fault_free_output(rounds: dict) -> None:
    kept = 0
    for before, after in zip(rounds["first"], rounds["second"], strict=True):
        if not errored(after):
            assert output_tokens(after[1]) == output_tokens(before[1])
            kept += 1
    assert kept > 0


def test_prompt_tokens_differ_by_the_prompts_failed_before_their_first_output(
        rounds: dict) -> None:
    ours, vllm = rounds["ours"], rounds["vllm"]
    failed_prompt_tokens = sum(len(p) for p, a in zip(PROMPTS, rounds["second"], strict=True)
                               if errored(a))
    assert total(ours, "kvmetrics_prompt_tokens_total") - \
        total(vllm, "vllm:prompt_tokens_by_source_total") == failed_prompt_tokens
    # Per source: the failed requests' loaded tokens are the whole external difference.
    failed_loaded = sum(loaded_tokens(p) for p, a in zip(PROMPTS, rounds["second"],
                                                           strict=True) if errored(a))
    assert total(ours, "kvmetrics_prompt_tokens_total", source="external") - \
        total(vllm, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == \
        failed_loaded


def test_the_server_stays_up(server: VllmServer, rounds: dict) -> None:
    assert server.process is not None and server.process.poll() is None
    status, body = server.complete(list(range(40, 90)), MAX_TOKENS)
    assert status == 200 and len(output_tokens(body)) == MAX_TOKENS
