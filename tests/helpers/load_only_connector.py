"""vLLM's ExampleConnector that never saves a prompt carrying a mark.

ExampleConnector saves every new prompt it does not hold yet, in the step that
computes it. For ``fail-sharer-blocks-hashed`` that hides the scheduler's defect
behind a connector-side one: the sharer's KV, computed over the failed block in the
failing step, would be saved too, and the sharer's retry would load it back from
the store whatever the scheduler does (docs/vllm-defects.md). Many deployments have
no such write: a decode instance in prefill/decode disaggregation only ever loads.
This subclass behaves that way for prompts that contain ``LOAD_ONLY_MARK`` (an id
the greedy prompts never use) and exactly like ExampleConnector for the others, so
the test shows what vLLM's prefix cache alone serves on a retry.
tests/test_serve_fail_sharer.py runs it inside FaultInjectingConnector.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

#: Token id that marks a prompt the connector must not save (greedy prompts use 3..1002,
#: tests/helpers/slow_connector.py uses 1010).
LOAD_ONLY_MARK = 1011


class LoadOnlyExampleConnector(ExampleConnector):
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        meta.requests = [r for r in meta.requests
                         if not (r.is_store and bool((r.token_ids == LOAD_ONLY_MARK).any()))]
        return meta
