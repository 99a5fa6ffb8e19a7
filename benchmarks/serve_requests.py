"""What the end-to-end tests send a real ``vllm serve`` and read back from its answers.

Prompts as token ids (the served tiny Llama has no tokenizer), the completion answer's
fields the tests compare, and the fault-injecting connector's configuration around
vLLM's ``ExampleConnector`` that the connector tests run (:mod:`benchmarks.vllm_server`
starts the server).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.vllm_server import BLOCK_SIZE, ServerError

__all__ = ["CONNECTOR_PROMPTS", "connector_config", "errored", "greedy_prompts",
           "loaded_tokens", "output_tokens", "request_id_of"]


def output_tokens(body: dict[str, Any]) -> list[int]:
    """The generated token ids of a one-choice completion answer."""
    choice = body["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        raise ServerError(f"no token_ids in the answer: {body}")
    return list(ids)


def errored(answer: tuple[int, dict[str, Any]]) -> bool:
    """Whether a completion answer (HTTP status, body) is an error a client sees."""
    status, body = answer
    return status != 200 or body["choices"][0].get("finish_reason") not in ("length", "stop")


def greedy_prompts(count: int, seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Distinct token-id prompts (ids 3..1002) of the given lengths, cycled."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 1003) for _ in range(lengths[i % len(lengths)])]
            for i in range(count)]


def request_id_of(body: dict[str, Any]) -> str:
    """The completion's id (vLLM's engine request id starts with it)."""
    return str(body.get("id", ""))


def loaded_tokens(prompt: list[int]) -> int:
    """What ExampleConnector loads: the prompt minus its last token, in whole blocks."""
    return (len(prompt) - 2) // BLOCK_SIZE * BLOCK_SIZE


def connector_config(storage: Path, policy: str, **faults: Any) -> dict[str, Any]:
    """FaultInjectingConnector around ExampleConnector; a seeded half of loads fail."""
    return {
        "kv_connector": "FaultInjectingConnector",
        "kv_connector_module_path": "kvmetrics.faults.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "inner_connector": "ExampleConnector",
            "inner_extra_config": {"shared_storage_path": str(storage)},
            "fault_rate": 0.5, "fault_seed": 3, "fault_mode": "mixed", **faults},
    }


#: Prompts of the connector tests (sequential rounds): distinct, 70-150 tokens.
CONNECTOR_PROMPTS = greedy_prompts(10, seed=5, lengths=(100, 70, 130, 150))
