"""NIXL prefill/decode in two real ``vllm serve`` processes, the decode side wrapped
by ``FaultInjectingNixlConnector`` at ``fault_rate`` 0.3 and the prefill side stock.

This is the fault rehearsal the docs show. The wrapper mirrors NixlConnector's
interfaces, so both sides keep the hybrid KV cache manager flag NIXL hashes into
the compatibility check its handshake compares: the transfers go through and only
the planned share of loads fails (with the plain ``FaultInjectingConnector``, every
handshake failed with "NIXL compatibility hash mismatch" and every request was
recomputed). Oracles kvmetrics did not compute:

- the fault plan itself (a pure function of seed and load number) says which of
  the decode server's loads fail: 2 of 6 here; the wrapper's log lines name them;
- vLLM's "Recovered from KV load failure" lines give failed requests and rolled-back
  tokens (NIXL's own request-level failures, ``_handle_failed_recving``, log
  nothing; none happen here: ``vllm:nixl_num_failed_transfers`` stays 0);
- the prefill server's own greedy completion of each prompt, computed locally
  without any transfer, is the fault-free output;
- the decode server's ``/metrics`` gives the external hits.

The six prompts are measured in a window that opens after ``shake_hands``: on a
loaded machine NIXL's first handshake can miss vLLM's fixed 5 s timeout, and that
request's load then fails for NIXL's own reason (vLLM and kvmetrics both count it).
Every count below is the window's: the page at its end minus the page at its start,
the log from its start.

NIXL keeps a thread busy per worker: six prompts, one pair of servers for the module,
their threads unpinned (``nixl_pd.CPU_THREADS``: with vLLM's default pinning its P/D
part took 3 to 4 minutes instead of 20 to 50 s on two busy cores, and stalled for
minutes before; docs/connectors.md, "NIXL on two CPU cores"). The handshake warm-up
is the only retry, bounded (3 requests) and reported as a warning when it took more
than one.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from benchmarks.serve_requests import greedy_prompts, output_tokens
from benchmarks.vllm_server import RECOVERED, VllmServer, total
from kvmetrics.faults.fault_plan import FaultPlan, parse_settings
from kvmetrics.metrics import catalogue
from tests.helpers.nixl_pd import (
    HASH_MISMATCH,
    nixl_transfer,
    pd_complete,
    pd_specs,
    shake_hands,
    started,
)

pytestmark = pytest.mark.serve

PROMPTS = greedy_prompts(6, seed=8, lengths=(100, 70, 130))
WARM_UP = greedy_prompts(1, seed=9, lengths=(90,))[0]
MAX_TOKENS = 6
FAULTS = {"fault_rate": 0.3, "fault_seed": 10}
INJECTED = re.compile(r"failing load #(\d+) of request (\S+) \((sync|async|emulated)\)")


@pytest.fixture(scope="module")
def rounds(tmp_path_factory: pytest.TempPathFactory) -> dict:
    work: Path = tmp_path_factory.mktemp("serve-nixl")
    prefill_spec, decode_spec = pd_specs(
        decode_transfer=nixl_transfer("recompute", wrapped=FAULTS))
    prefill = VllmServer(prefill_spec, work, "prefill")
    decode = VllmServer(decode_spec, work, "decode")
    with started(prefill, decode):
        warm_ups = shake_hands(prefill, decode, WARM_UP)
        if warm_ups > 1:
            warnings.warn(f"NIXL's first handshake needed {warm_ups} warm-up requests "
                          "(the earlier ones missed vLLM's 5 s answer timeout)", stacklevel=1)
        local = []
        for prompt in PROMPTS:  # the fault-free outputs, computed on prefill alone
            status, body = prefill.complete(prompt, MAX_TOKENS)
            assert status == 200, body
            local.append(output_tokens(body))
        before = decode.pages_when_finished(warm_ups)
        prefill_before = prefill.vllm_metrics()
        log_start = len(decode.log())
        answers = [pd_complete(prefill, decode, p, MAX_TOKENS) for p in PROMPTS]
        theirs, ours = decode.pages_when_finished(warm_ups + len(PROMPTS))
        return {"local": local, "answers": answers, "warm_ups": warm_ups,
                "vllm": theirs, "ours": ours, "vllm_before": before[0],
                "ours_before": before[1], "prefill_vllm": prefill.vllm_metrics(),
                "prefill_vllm_before": prefill_before, "log": decode.log()[log_start:],
                "whole_log": decode.log(), "prefill_log": prefill.log()}


def window(rounds: dict, page: str, name: str, **labels: str) -> float:
    """How much ``name`` grew on ``page`` ("vllm", "ours", "prefill_vllm") in the window."""
    return total(rounds[page], name, **labels) - total(rounds[page + "_before"], name, **labels)


def test_no_hash_mismatch_and_every_output_equals_the_fault_free_one(rounds: dict) -> None:
    assert HASH_MISMATCH not in rounds["whole_log"]
    assert HASH_MISMATCH not in rounds["prefill_log"]
    assert all(status == 200 for status, _ in rounds["answers"]), rounds["answers"]
    assert [output_tokens(body) for _, body in rounds["answers"]] == rounds["local"]
    assert len({tuple(o) for o in rounds["local"]}) == len(PROMPTS)


def test_the_planned_share_of_loads_fails(rounds: dict) -> None:
    plan = FaultPlan(parse_settings({"inner_connector": "NixlConnector", **FAULTS}))
    # One load per request: the warm-ups took the first numbers.
    loads = range(rounds["warm_ups"] + 1, rounds["warm_ups"] + len(PROMPTS) + 1)
    planned = [n for n in loads if plan.fails(n)]
    assert 0 < len(planned) < len(PROMPTS)  # about 30%
    injected = INJECTED.findall(rounds["log"])
    assert [int(n) for n, _, _ in injected] == planned
    assert {mode for _, _, mode in injected} == {"async"}  # NIXL loads asynchronously
    # Every load was transferred by NIXL; the failures are the wrapper's only.
    for page in ("vllm", "prefill_vllm"):
        assert served(rounds[page], "vllm:nixl_num_failed_transfers_total")
        assert window(rounds, page, "vllm:nixl_num_failed_transfers_total") == 0
    assert window(rounds, "vllm", "vllm:external_prefix_cache_hits_total") > 0


def served(page: str, name: str) -> bool:
    """Whether ``page`` has a sample of ``name`` (a 0 from an absent series proves nothing)."""
    return re.search(rf"^{re.escape(name)}[{{ ]", page, re.MULTILINE) is not None


def test_the_dashboards_vllm_series_exist_under_these_names(rounds: dict) -> None:
    """catalogue.VLLM_SERIES, the dashboard's allow-list, spells vLLM 0.32's names."""
    for spec in catalogue.VLLM_SERIES:
        assert served(rounds["vllm"], spec.name) or served(rounds["prefill_vllm"], spec.name), \
            spec.name
        for page in (rounds["vllm"], rounds["prefill_vllm"]):
            for line in re.findall(rf"^{re.escape(spec.name)}\{{([^}}]*)\}}", page, re.M):
                labels = {kv.split("=")[0] for kv in line.split(",") if kv}
                assert labels == set(spec.label_names), (spec.name, labels)


def test_failed_requests_and_rolled_back_tokens_equal_vllms_log(rounds: dict) -> None:
    lines = RECOVERED.findall(rounds["log"])
    failed = sum(int(n) for n, _ in lines)
    assert failed == len(INJECTED.findall(rounds["log"]))
    assert window(rounds, "ours", "kvmetrics_kv_load_failed_requests_total",
                  action="rescheduled", policy="recompute", mode="async") == failed
    assert window(rounds, "ours", "kvmetrics_kv_load_failed_requests_total",
                  action="failed") == 0
    assert window(rounds, "ours", "kvmetrics_rolled_back_tokens_total") == \
        sum(int(m) for _, m in lines)
    assert window(rounds, "ours", "kvmetrics_prefix_cache_hit_tokens_total",
                  source="external") == \
        window(rounds, "vllm", "vllm:external_prefix_cache_hits_total")
