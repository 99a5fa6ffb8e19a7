"""Batched block copies from the host store into the device cache.

A load is ``cache[block_ids[i]] = store[slots[i]]`` for many blocks at once.
Torch has no single-pass indexed-to-indexed copy, so it is a gather (``index_select``,
which copies whole rows with ``memcpy``) followed by a scatter (``index_copy_``).
Two things keep it close to a plain contiguous ``copy_`` of the same bytes
(``benchmarks/bench_dataplane.py`` measures the ratio):

* **Wide rows.** Blocks are reinterpreted as rows of the widest element type
  that divides them (16-byte elements on the CPU): the index kernels' per-element
  cost is paid 4x less often than with float32 elements. Plain loads and stores
  move the bits unchanged, NaN payloads included.
* **Chunks.** Large loads go through in chunks of about ``chunk_bytes``: on the
  CPU the gathered chunk is still in cache when the scatter reads it (one trip to
  memory instead of two); with CUDA the gather of chunk ``k+1`` into pinned
  memory overlaps the asynchronous host->device copy of chunk ``k``. The loop is
  over chunks of many blocks, never over blocks.
* **Runs.** Real loads are mostly runs: a request's prefix blocks were saved to
  consecutive store slots and land in blocks the pool handed out in order. A run
  of ``n`` blocks adjacent on both sides is one slice ``copy_`` (a single memcpy,
  or one DMA from pinned memory with CUDA), exactly what a contiguous copy does.
  Runs shorter than ``min_run_bytes`` still go through the gather/scatter, where
  one kernel for many scattered blocks beats a copy call per block. The loop is
  over runs, found with a few vector ops (:func:`runs`), never over blocks.
"""

from __future__ import annotations

import numpy as np
import torch

#: About one L2 cache's worth: the gathered chunk is re-read from cache by the scatter.
DEFAULT_CHUNK_BYTES = 1 << 20
#: A run at least this large (two 64 KiB blocks) is copied as one slice; below it the
#: per-call overhead of
#: a slice copy (a few microseconds) costs more than the gather/scatter's second pass.
DEFAULT_MIN_RUN_BYTES = 128 << 10
#: Runs are looked for only when this many blocks or fewer make a long-enough run
#: (blocks of at least 2 KiB with the default threshold).
MAX_RUN_BLOCKS = 64

_WIDE = ((torch.complex128, 16), (torch.int64, 8), (torch.int32, 4), (torch.int16, 2))


def row_view(t: torch.Tensor, wide: bool = True) -> torch.Tensor:
    """``t`` ([n, ...], contiguous) as ``[n, row]`` of the widest type dividing a row."""
    n = t.shape[0]
    flat = t.view(n, -1)
    if not wide or n == 0:
        return flat
    row_bytes = flat.shape[1] * t.element_size()
    for dtype, width in _WIDE:
        if width >= t.element_size() and row_bytes % width == 0:
            return flat.view(dtype)
    return flat


def _as_array(ids: torch.Tensor | None, n: int) -> np.ndarray:
    if ids is None:
        return np.arange(n, dtype=np.int64)
    return ids.to("cpu", torch.int64).numpy()


def _run_starts(d: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start positions and lengths of the maximal runs where ``d`` and ``s`` both go up
    by exactly one. The index arithmetic is done in numpy on the (CPU) id tensors'
    memory: a handful of vector ops, cheaper per call than torch's dispatch."""
    breaks = np.flatnonzero((np.diff(d) != 1) | (np.diff(s) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    return starts, np.diff(starts, append=len(d))


def runs(dst_ids: torch.Tensor, src_ids: torch.Tensor | None = None) -> list[tuple[int, int, int]]:
    """Maximal runs ``(dst_start, src_start, length)`` over which ``dst_ids`` and
    ``src_ids`` (default: ``0, 1, 2, ...``) both go up by exactly one."""
    n = dst_ids.numel()
    if n == 0:
        return []
    d, s = _as_array(dst_ids, n), _as_array(src_ids, n)
    starts, lengths = _run_starts(d, s)
    return list(zip(d[starts].tolist(), s[starts].tolist(), lengths.tolist(), strict=True))


def copy_runs(dst: torch.Tensor, dst_ids: torch.Tensor, src: torch.Tensor,
              src_ids: torch.Tensor | None = None, min_run_bytes: int = 0,
              non_blocking: bool = False) -> torch.Tensor | None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for the blocks in runs of at least
    ``min_run_bytes``, one slice copy per run; returns the positions (into the id
    tensors) of the blocks left for the caller, or None when none is left."""
    n = dst_ids.numel()
    if n == 0:
        return None
    row_bytes = (src.numel() // max(src.shape[0], 1)) * src.element_size()
    min_len = max(1, -(-min_run_bytes // max(row_bytes, 1)))
    if n < min_len or min_len > MAX_RUN_BLOCKS:
        # Small blocks: a run would need so many of them that looking for runs (about
        # 20 ns a block) costs more than the slice copies could save.
        return torch.arange(n)
    d, s = _as_array(dst_ids, n), _as_array(src_ids, n)
    starts, lengths = _run_starts(d, s)
    long = lengths >= min_len
    if not long.any():
        return torch.arange(n)  # a scattered layout: leave it all to one batched kernel
    for d0, s0, length in zip(d[starts[long]].tolist(), s[starts[long]].tolist(),
                              lengths[long].tolist(), strict=True):
        dst[d0:d0 + length].copy_(src[s0:s0 + length], non_blocking=non_blocking)
    if long.all():
        return None
    return torch.from_numpy(np.flatnonzero(np.repeat(~long, lengths)))


class BlockCopier:
    """Copies blocks host store -> device cache for one device, in index-driven batches."""

    def __init__(self, device: torch.device, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 min_run_bytes: int = DEFAULT_MIN_RUN_BYTES) -> None:
        self.device = device
        self.chunk_bytes = max(1, chunk_bytes)
        self.min_run_bytes = min_run_bytes
        # CUDA kernels run at memory speed anyway; keep the native dtype there.
        self.wide = device.type == "cpu"

    def _rows_per_chunk(self, row_bytes: int) -> int:
        return max(1, self.chunk_bytes // max(1, row_bytes))

    def copy(self, dst: torch.Tensor, dst_ids: torch.Tensor, src: torch.Tensor,
             src_ids: torch.Tensor) -> None:
        """``dst[dst_ids[i]] = src[src_ids[i]]``; ``src`` on the host, ``dst`` on the device."""
        if src_ids.numel() == 0:
            return
        d, s = row_view(dst, self.wide), row_view(src, self.wide)
        src_ids = src_ids.to("cpu")
        rest = copy_runs(d, dst_ids.to("cpu"), s, src_ids, self.min_run_bytes,
                         non_blocking=self.device.type != "cpu")
        if rest is None:
            return
        if rest.numel() != src_ids.numel():
            src_ids, dst_ids = src_ids[rest], dst_ids.to("cpu")[rest]
        self._gather_scatter(d, dst_ids, s, src_ids)

    def _gather_scatter(self, d: torch.Tensor, dst_ids: torch.Tensor, s: torch.Tensor,
                        src_ids: torch.Tensor) -> None:
        """The scattered blocks: gather rows of the host tensor, scatter them, in chunks."""
        n = src_ids.numel()
        src_ids = src_ids.to("cpu")
        dst_ids = dst_ids.to(self.device, non_blocking=True)
        step = self._rows_per_chunk(s.shape[1] * s.element_size())
        on_host = self.device.type == "cpu"
        buf = torch.empty((min(step, n), s.shape[1]), dtype=s.dtype) if on_host else None
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            if buf is not None:
                rows = buf[:hi - lo]
                torch.index_select(s, 0, src_ids[lo:hi], out=rows)
            else:
                # A fresh pinned buffer per chunk: the caching host allocator keeps
                # it alive until its asynchronous copy has finished.
                staged = torch.empty((hi - lo, s.shape[1]), dtype=s.dtype,
                                     pin_memory=s.is_pinned())
                torch.index_select(s, 0, src_ids[lo:hi], out=staged)
                rows = staged.to(self.device, non_blocking=True)
            d.index_copy_(0, dst_ids[lo:hi], rows)

    def gather(self, src: torch.Tensor, src_ids: torch.Tensor) -> torch.Tensor:
        """``src[src_ids]`` on the device (the rows an async load will land later)."""
        if self.device.type == "cpu":
            return src.index_select(0, src_ids.to("cpu"))
        out = torch.empty((src_ids.numel(), *src.shape[1:]), dtype=src.dtype,
                          device=self.device)
        if src_ids.numel():
            self.copy(out, torch.arange(src_ids.numel(), device=self.device), src, src_ids)
        return out
