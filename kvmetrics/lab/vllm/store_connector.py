"""A vLLM KV connector backed by kvmetrics' external store index.

vLLM instantiates connectors itself (from ``kv_connector_module_path`` and the
class name), so the store cannot be passed in: the test or lab registers it
under a key with :func:`register_store` and names the key in
``kv_connector_extra_config["store_key"]``. vLLM imports the module again by
name, which yields the same module object and therefore the same registry.

Only the scheduler side is real. It mirrors
:class:`kvmetrics.lab.engine.connector.StoreConnector` exactly (the longest run of
the request's next full blocks present in the store, never the last token, load
mode from :func:`choose_load_mode`) and hands the loads to do to the model
runner in its metadata. The worker side is played by kvmetrics' model runners
(:mod:`kvmetrics.lab.vllm.runner`), so the worker hooks do nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvmetrics.lab.engine.connector import LOAD_MODES, StoreConnector
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.outputs import LoadSpec

_lock = threading.Lock()
_stores: dict[str, ExternalStoreIndex] = {}

#: Capacity of a store the connector creates itself when its key is unknown.
DEFAULT_CAPACITY_BLOCKS = 4096


def register_store(key: str, store: ExternalStoreIndex) -> None:
    """Make ``store`` the external tier of every connector configured with ``key``."""
    with _lock:
        _stores[key] = store


def unregister_store(key: str) -> None:
    with _lock:
        _stores.pop(key, None)


def get_store(key: str, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS) -> ExternalStoreIndex:
    """The store registered under ``key``, created empty if nobody registered one."""
    with _lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = ExternalStoreIndex(capacity_blocks)
        return store


@dataclass
class KvmetricsConnectorMetadata(KVConnectorMetadata):
    """What the runner must do for the connector in one step: the loads to start."""

    loads: list[LoadSpec] = field(default_factory=list)


class KvmetricsStoreConnector(KVConnectorBase_V1):
    """Scheduler side of the built-in store connector, as a vLLM connector."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        mode = str(extra.get("load_mode", "sync"))
        if mode not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {LOAD_MODES}, got {mode!r}")
        self.store_key = str(extra.get("store_key", "default"))
        self.store = get_store(self.store_key,
                               int(extra.get("capacity_blocks", DEFAULT_CAPACITY_BLOCKS)))
        self.block_size = vllm_config.cache_config.block_size
        # The reference engine's connector decides; vLLM's requests have the same
        # fields it reads (request_id, num_tokens, block_hashes).
        self.matcher = StoreConnector(self.store, self.block_size, mode,
                                      int(extra.get("seed", 0)))

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to a preemption is only a future miss.
        return False

    # -- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.matcher.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        (block_ids,) = blocks.get_block_ids()
        self.matcher.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvmetricsConnectorMetadata:
        return KvmetricsConnectorMetadata(loads=self.matcher.take_loads())

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.matcher.request_finished(request)
        return False, None

    # -- worker side: played by kvmetrics' model runners ------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
