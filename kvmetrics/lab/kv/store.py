"""The external KV tier's data: one host tensor indexed by the store index's slots.

:class:`~kvmetrics.lab.engine.external_store.ExternalStoreIndex` decides which block
hash lives in which slot and what LRU evicts; it is shared with the tensor-less
executor so both runners make the same store decisions. This module only holds
the bytes; :mod:`kvmetrics.lab.kv.copy` moves them into the device cache. With CUDA
the tensor is pinned so that host<->device copies run as asynchronous DMA.
Slots never written are NaN, like the device cache, so a bug that loads one is
caught by the verifier rather than served as plausible KV.
"""

from __future__ import annotations

import torch

from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.kv.cache import RUN_BYTES, tensor_digest
from kvmetrics.lab.kv.copy import copy_runs


class HostKVStore:
    def __init__(self, index: ExternalStoreIndex, block_size: int, kv_dim: int,
                 dtype: torch.dtype = torch.float32, pin_memory: bool = False) -> None:
        self.index = index
        self.block_size = block_size
        self.kv_dim = kv_dim
        self.pin_memory = pin_memory
        self.data = torch.full((index.capacity, block_size, kv_dim), float("nan"), dtype=dtype,
                               pin_memory=pin_memory)

    @property
    def capacity(self) -> int:
        return self.index.capacity

    def scatter(self, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write blocks into ``slots`` (device->host when the cache is on a GPU); runs of
        adjacent slots are one slice copy each."""
        if not slots.numel():
            return
        blocks = blocks.to("cpu")
        slots = slots.to("cpu")
        rest = copy_runs(self.data, slots, blocks, min_run_bytes=RUN_BYTES)
        if rest is not None:
            self.data.index_copy_(0, slots[rest], blocks[rest])

    def checksum(self) -> str:
        return tensor_digest(self.data)
