"""Batched block copies: runs of adjacent blocks are slice copies, the rest one kernel,
and either way every block lands where a naive per-block copy would put it."""

from __future__ import annotations

import random

import pytest
import torch

from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.kv.cache import KVCache
from kvmetrics.lab.kv.copy import BlockCopier, copy_runs, runs
from kvmetrics.lab.kv.device import available_devices
from kvmetrics.lab.kv.store import HostKVStore

DEVICES = available_devices()


def _layout(rng: random.Random, n: int, space: int, run_share: float) -> list[int]:
    """``n`` distinct ids in 0..space-1: runs of adjacent ids mixed with singles."""
    free = list(range(space))
    rng.shuffle(free)
    taken: set[int] = set()
    ids: list[int] = []
    for start in free:
        if len(ids) >= n:
            break
        length = rng.randint(2, 12) if rng.random() < run_share else 1
        run = [i for i in range(start, min(start + length, space)) if i not in taken]
        run = run[: n - len(ids)]
        ids.extend(run)
        taken.update(run)
    return ids


def test_runs_of_a_hand_worked_example() -> None:
    dst = torch.tensor([5, 6, 7, 2, 3, 9])
    src = torch.tensor([0, 1, 2, 8, 9, 4])
    assert runs(dst, src) == [(5, 0, 3), (2, 8, 2), (9, 4, 1)]
    assert runs(torch.tensor([4, 5, 6])) == [(4, 0, 3)]
    assert runs(torch.tensor([3, 4]), torch.tensor([7, 9])) == [(3, 7, 1), (4, 9, 1)]


def test_copy_runs_leaves_short_runs_to_the_caller() -> None:
    src = torch.arange(40, dtype=torch.float32).view(10, 4)  # 16-byte rows
    dst = torch.zeros(10, 4)
    rest = copy_runs(dst, torch.tensor([0, 1, 2, 7, 5]), src, torch.tensor([3, 4, 5, 0, 9]),
                     min_run_bytes=48)
    assert rest.tolist() == [3, 4]  # the singles 7<-0 and 5<-9
    assert torch.equal(dst[0:3], src[3:6]) and not dst[7].any() and not dst[5].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("run_share", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("min_run_bytes", [0, 256, 1 << 20])
def test_block_copier_equals_a_per_block_copy(device: str, run_share: float,
                                              min_run_bytes: int) -> None:
    rng = random.Random(f"{run_share}-{min_run_bytes}")
    gen = torch.Generator().manual_seed(7)
    store = torch.randn(96, 4, 8, generator=gen)
    for trial in range(20):
        n = rng.randint(1, 60)
        slots = _layout(rng, n, 96, run_share)
        ids = _layout(rng, n, 80, run_share)
        n = min(len(slots), len(ids))
        slots, ids = slots[:n], ids[:n]
        cache = torch.full((80, 4, 8), float("nan"), device=device)
        expected = cache.clone()
        for b, s in zip(ids, slots, strict=True):
            expected[b] = store[s].to(device)
        copier = BlockCopier(torch.device(device), chunk_bytes=300, min_run_bytes=min_run_bytes)
        copier.copy(cache, torch.tensor(ids, device=device), store, torch.tensor(slots))
        assert torch.equal(cache.isnan(), expected.isnan()), trial
        assert torch.equal(cache.nan_to_num(), expected.nan_to_num()), trial


@pytest.mark.parametrize("device", DEVICES)
def test_cache_and_store_copy_runs_and_scattered_blocks(device: str) -> None:
    """128 KiB blocks, so that runs of two and more take the slice path (RUN_BYTES)."""
    rng = random.Random(3)
    cache = KVCache(64, 4, 8192, device=device)
    host = HostKVStore(ExternalStoreIndex(64), 4, 8192)
    for _ in range(6):
        ids = _layout(rng, 30, 64, 0.6)
        blocks = torch.randn(len(ids), 4, 8192, device=device)
        cache.load_blocks(torch.tensor(ids), blocks)
        assert torch.equal(cache.read_blocks(torch.tensor(ids)), blocks)
        slots = _layout(rng, len(ids), 64, 0.6)
        host.scatter(torch.tensor(slots), blocks)
        assert torch.equal(host.data[torch.tensor(slots)], blocks.cpu())
