"""FaultInjectingConnector around vLLM's ExampleConnector in a real ``vllm serve``,
policy ``recompute``: recovery is invisible to clients and kvmetrics counts it exactly.

Round 1 sends distinct prompts one at a time: nothing is stored yet, so they are
computed, and ExampleConnector saves their KV to disk. The prefix cache is reset,
and round 2 sends the same prompts again: each is now loaded through the
connector (a *load*), and a seeded half of the loads fail, some in one block of a
sync load, some as a whole async load (``fault_mode="mixed"``). The oracles are
not computed by kvmetrics:

- greedy outputs of round 2 equal round 1 (the fault-free run);
- vLLM's own log lines "Recovered from KV load failure: N request(s) rescheduled
  (M tokens affected)" give the failed requests (sum of N) and rolled-back tokens
  (sum of M);
- the connector's worker-side log lines "failing load #n of request R (mode):
  blocks [...]" give the failed blocks per mode;
- vLLM's ``/metrics`` gives external queries and hits, and (ExampleConnector loads
  whole blocks) the loaded blocks, hits / 32;
- recomputed tokens are worked out by hand: a failed sync load recomputes what
  was rolled back plus the tail the failed step computed (prompt minus loaded
  tokens); an async failure recomputes nothing, as its retry loads again.

A third round runs while a real Prometheus scrapes vLLM's endpoint and kvmetrics'
endpoint with the shipped rules: both sides agree there too, every recording rule
in deploy/prometheus/rules.yml returns series for the real server and every rule
evaluates cleanly. (The alerts need minutes of traffic above their thresholds, more
than a CI test should spend; README "Rehearse alerts" shows the staging recipe.)

Measured on the 2-core CI kind of machine: the server starts in 45-60 s; the
module takes about 100 s.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml

from benchmarks.serve_requests import (
    CONNECTOR_PROMPTS,
    connector_config,
    loaded_tokens,
    output_tokens,
    request_id_of,
)
from benchmarks.vllm_server import BLOCK_SIZE, RECOVERED, ServerSpec, VllmServer, total
from tests.helpers.prometheus import running_prometheus, scrape_config

pytestmark = [pytest.mark.prometheus, pytest.mark.serve]

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
PROMPTS = CONNECTOR_PROMPTS
MAX_TOKENS = 10
INJECTED = re.compile(r"failing load #(\d+) of request (\S+) \((sync|async|emulated)\): "
                      r"blocks \[([\d, ]*)\]")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("serve-recompute")
    spec = ServerSpec(kv_transfer=connector_config(work / "kv", "recompute"))
    with VllmServer(spec, work) as s:
        yield s


def run_round(server: VllmServer) -> list[tuple[str, list[int]]]:
    answers = []
    for prompt in PROMPTS:
        status, body = server.complete(prompt, MAX_TOKENS)
        assert status == 200, body
        answers.append((request_id_of(body), output_tokens(body)))
    return answers


@pytest.fixture(scope="module")
def rounds(server: VllmServer) -> dict:
    first = run_round(server)
    server.reset_prefix_cache()
    second = run_round(server)
    theirs, ours = server.pages_when_finished(2 * len(PROMPTS))
    return {"first": first, "second": second, "vllm": theirs, "ours": ours,
            "log": server.log()}


def injected(log: str) -> list[tuple[int, str, str, list[int]]]:
    return [(int(m[1]), m[2], m[3], [int(b) for b in m[4].split(",") if b.strip()])
            for m in INJECTED.finditer(log)]


def test_every_request_succeeds_with_the_fault_free_output(rounds: dict) -> None:
    assert [out for _, out in rounds["second"]] == [out for _, out in rounds["first"]]
    faults = injected(rounds["log"])
    modes = {mode for _, _, mode, _ in faults}
    assert modes == {"sync", "emulated"}, faults  # the seed exercises both paths
    # Outputs depend on the prompt, so equal outputs are not an accident.
    assert len({tuple(out) for _, out in rounds["first"]}) == len(PROMPTS)


def test_failed_requests_and_rolled_back_tokens_equal_vllms_log(rounds: dict) -> None:
    ours = rounds["ours"]
    lines = RECOVERED.findall(rounds["log"])
    assert lines, "no recovery happened"
    assert total(ours, "kvmetrics_kv_load_failed_requests_total", action="rescheduled",
                 policy="recompute") == sum(int(n) for n, _ in lines)
    assert total(ours, "kvmetrics_kv_load_failed_requests_total", action="failed") == 0
    assert total(ours, "kvmetrics_rolled_back_tokens_total") == sum(int(m) for _, m in lines)
    faults = injected(rounds["log"])
    for mode, ours_mode in (("sync", "sync"), ("emulated", "async")):
        assert total(ours, "kvmetrics_kv_load_failed_requests_total", mode=ours_mode) == \
            sum(1 for f in faults if f[2] == mode)


def test_load_blocks_and_external_hits_equal_the_connectors_and_vllms(rounds: dict) -> None:
    ours, vllm = rounds["ours"], rounds["vllm"]
    faults = injected(rounds["log"])
    for mode, ours_mode in (("sync", "sync"), ("emulated", "async")):
        assert total(ours, "kvmetrics_kv_load_blocks_total", mode=ours_mode, outcome="failed") \
            == sum(len(f[3]) for f in faults if f[2] == mode)
    hits = total(vllm, "vllm:external_prefix_cache_hits_total")
    assert total(ours, "kvmetrics_prefix_cache_hit_tokens_total", source="external") == hits
    assert total(ours, "kvmetrics_prefix_cache_query_tokens_total", source="external") == \
        total(vllm, "vllm:external_prefix_cache_queries_total")
    assert total(ours, "kvmetrics_kv_load_blocks_total") == hits / BLOCK_SIZE
    # Round 2 loads every prompt once (plus the retries of failed async loads).
    assert total(ours, "kvmetrics_prompt_tokens_total", source="external") == \
        sum(loaded_tokens(p) for p in PROMPTS)
    assert total(vllm, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") \
        == sum(loaded_tokens(p) for p in PROMPTS)


def test_recomputed_tokens_match_the_hand_count(rounds: dict) -> None:
    ours = rounds["ours"]
    by_id = {rid: prompt for (rid, _), prompt in zip(rounds["second"], PROMPTS, strict=True)}
    tails = 0
    for _, rid, mode, _ in injected(rounds["log"]):
        if mode == "sync":
            prompt = next(p for prefix, p in by_id.items() if rid.startswith(prefix))
            tails += len(prompt) - loaded_tokens(prompt)
    rolled_sync = total(ours, "kvmetrics_rolled_back_tokens_total", mode="sync")
    assert rolled_sync > 0
    assert total(ours, "kvmetrics_recomputed_tokens_total", cause="kv_load_failure") == \
        rolled_sync + tails
    assert total(ours, "kvmetrics_recomputed_tokens_total", cause="preemption") == 0


def test_prometheus_scrapes_both_endpoints_and_the_rules_return_data(
        server: VllmServer, rounds: dict) -> None:
    jobs = [scrape_config("vllm", [f"127.0.0.1:{server.port}"]),
            scrape_config("kvmetrics-vllm", [f"127.0.0.1:{server.kvmetrics_port}"])]
    records = [r["record"] for g in yaml.safe_load(RULES.read_text())["groups"]
               for r in g["rules"] if "record" in r]
    with running_prometheus(scrape_configs=jobs, rule_files=[RULES]) as prom:
        prom.wait_for_scrape()
        server.reset_prefix_cache()
        third = run_round(server)  # traffic while Prometheus watches
        assert [o for _, o in third] == [o for _, o in rounds["first"]]
        server.pages_when_finished(3 * len(PROMPTS))  # the third round counted
        prom.wait_for_scrape(after=time.time())
        time.sleep(2.5)  # two rule evaluations over the fresh samples
        at = prom.wait_for_scrape(after=time.time())
        # Both admissions: vLLM counts the lookup again after a failed async load freed
        # every block (kvmetrics calls it a repeat); nothing is preempted here.
        ours = prom.query_value('sum(kvmetrics_prefix_cache_query_tokens_total'
                                '{job="kvmetrics-vllm", source="local"})')
        theirs = prom.query_value('sum(vllm:prefix_cache_queries_total{job="vllm"})')
        assert ours == theirs and ours > 0
        assert prom.query_value('sum(kvmetrics_prefix_cache_hit_tokens_total{source="external"})') \
            == prom.query_value("sum(vllm:external_prefix_cache_hits_total)")
        empty = [name for name in records if not prom.query(f'{name}{{model_name="tiny"}}', at=at)]
        assert not empty, f"recording rules without data for the real server: {empty}"
        rule = "kvmetrics:kv_load_failure_ratio:rate5m"
        sync = prom.query_value(f'{rule}{{model_name="tiny", mode="sync"}}')
        assert sync is not None and 0 < sync < 1  # one block of some sync loads
        # A failed async load here fails in every block (nothing was loaded).
        assert prom.query_value(f'{rule}{{model_name="tiny", mode="async"}}') == 1
        unhealthy = [(r["name"], r.get("lastError")) for g in prom.rules() for r in g["rules"]
                     if r["health"] != "ok"]
        assert not unhealthy
