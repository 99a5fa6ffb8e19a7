"""The device KV cache: one tensor for every block, addressed by the engine's block ids.

Keeping all blocks in one ``[num_blocks, block_size, kv_dim]`` tensor (as vLLM
does per layer) is what makes loads, writes and reads single batched indexing
operations instead of Python loops over blocks. Every block starts *poisoned*
(NaN): KV that nobody wrote can never pass for valid KV, and NaN never compares
equal, so a read of it is always a verification failure.
"""

from __future__ import annotations

import ctypes
import hashlib

import torch

from kvmetrics.lab.kv.copy import copy_runs


def tensor_digest(tensor: torch.Tensor) -> str:
    """blake2b of a tensor's raw bytes: equal iff bit-identical (NaN payloads included)."""
    t = tensor.detach().to("cpu").contiguous()
    raw = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def token_slots(block_table: torch.Tensor, positions: torch.Tensor,
                block_size: int) -> torch.Tensor:
    """Flat cache rows (``block_id * block_size + offset``) of token positions."""
    return block_table[positions // block_size] * block_size + positions % block_size


#: Runs of at least this many bytes are slice-copied (see kvmetrics.lab.kv.copy).
RUN_BYTES = 128 << 10


class KVCache:
    def __init__(self, num_blocks: int, block_size: int, kv_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if num_blocks < 1 or block_size < 1 or kv_dim < 1:
            raise ValueError("num_blocks, block_size and kv_dim must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_dim = kv_dim
        self.device = torch.device(device)
        self.data = torch.full((num_blocks, block_size, kv_dim), float("nan"), dtype=dtype,
                               device=self.device)
        #: The same storage seen as one row per token slot.
        self.flat = self.data.view(num_blocks * block_size, kv_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def load_blocks(self, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Copy whole blocks in: ``data[block_ids[i]] = blocks[i]``. Runs of adjacent ids
        are one slice copy each; what is left, one ``index_copy_``."""
        if not block_ids.numel():
            return
        blocks = blocks.to(self.device)
        rest = copy_runs(self.data, block_ids, blocks, min_run_bytes=RUN_BYTES)
        if rest is not None:
            self.data.index_copy_(0, block_ids.to("cpu")[rest].to(self.device), blocks[
                rest.to(self.device)])

    def poison_blocks(self, block_ids: torch.Tensor) -> None:
        """Fill blocks with NaN (a failed load must never leave stale KV readable)."""
        if block_ids.numel():
            self.data.index_fill_(0, block_ids.to(self.device), float("nan"))

    def read_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        return self.data.index_select(0, block_ids.to(self.device))

    def write_tokens(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write token rows through flat slots (what a forward pass's KV write does)."""
        if slots.numel():
            self.flat.index_copy_(0, slots, values)

    def read_tokens(self, slots: torch.Tensor) -> torch.Tensor:
        """Gather token rows (what attention reads through a block table)."""
        return self.flat.index_select(0, slots)

    def checksum(self) -> str:
        return tensor_digest(self.data)
