"""Connectors no vLLM ships, for what FaultInjectingConnector must do with interfaces
it has never heard of, and with vLLM 0.34's connector methods on any vLLM.

* ``SupportsTeleport`` stands for the next ``Supports*`` mixin vLLM adds: vLLM
  would check it with ``issubclass`` on the connector class, as it does
  ``SupportsHMA``. ``TeleportConnector`` declares it.
* ``AnsweringConnector`` answers vLLM 0.34's ``may_load_async``,
  ``kv_cache_access`` and ``supports_lookahead_block_hashes`` otherwise than the
  base does (0.34 is not installed here: the wrapper must forward them all the same).
* ``PlainConnector`` has nothing beyond the abstract methods.

Every method records its calls in ``calls``, so a test sees what reached the inner
connector. Loaded by the tests through ``inner_module_path`` / ``kv_connector_module_path``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

from kvmetrics.faults.connector import fault_injecting


class SupportsTeleport(ABC):
    """A capability kvmetrics has never heard of."""

    @abstractmethod
    def teleport(self, request_id: str) -> str:
        raise NotImplementedError

    def teleport_twice(self, request_id: str) -> str:
        return self.teleport(self.teleport(request_id))


class PlainConnector(KVConnectorBase_V1):
    """The abstract methods only: nothing for a wrapper to hide."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.calls: list[tuple[Any, ...]] = []

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


class TeleportConnector(PlainConnector, SupportsTeleport):
    def teleport(self, request_id: str) -> str:
        self.calls.append(("teleport", request_id))
        return f"{request_id}'"


class AnsweringConnector(PlainConnector):
    """vLLM 0.34's three additions, answered unlike the base's defaults."""

    def may_load_async(self, request: Any) -> bool:
        self.calls.append(("may_load_async", request.request_id))
        return request.request_id.startswith("async")

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        return ("registers", kv_transfer_config.kv_connector,
                dict(kv_transfer_config.kv_connector_extra_config))

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        return kv_transfer_config.kv_connector_extra_config.get("lookahead") == "yes"


#: How a connector module of one's own offers the mirrored wrapper.
FaultInjectingTeleportConnector = fault_injecting(TeleportConnector)
