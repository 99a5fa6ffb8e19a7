"""`kvmetrics run --otlp-endpoint`: the OTLP stream carries the summary's totals."""

from __future__ import annotations

import json

from tests.helpers.otlp import OTLPReceiver
from tests.lab_support import run_cli


def test_lab_pushes_the_same_totals_over_otlp() -> None:
    with OTLPReceiver() as receiver:
        result = run_cli("run", "--verify", "off", "--max-requests", "150", "--fault-rate", "0.3",
                         "--otlp-endpoint", receiver.endpoint, "--json")
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        sums = receiver.cumulative_sums()
        resources = receiver.resource_attributes()

    def total(name: str, **labels: str) -> float:
        return sum(v for (n, attrs), v in sums.items()
                   if n == name and all((k, val) in attrs for k, val in labels.items()))

    assert resources and resources[0]["kvmetrics.model_name"] == "kvmetrics-lab"
    assert total("kvmetrics_rolled_back_tokens") == summary["rolled_back_tokens"] > 0
    assert total("kvmetrics_kv_load_blocks", outcome="failed") == \
        summary["kv_load"]["blocks_failed"]
    assert total("kvmetrics_prefix_cache_hit_tokens", source="local", admission="first") == \
        summary["prefix_cache"]["local"]["hit_tokens"]
    assert total("kvmetrics_finished_requests") == 150
