"""Ground-truth KV, device resolution, and the cache / store / copy building blocks."""

from __future__ import annotations

import random

import pytest
import torch

from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.kv.cache import KVCache, tensor_digest, token_slots
from kvmetrics.lab.kv.copy import BlockCopier, row_view
from kvmetrics.lab.kv.device import available_devices, resolve_device, resolve_dtype
from kvmetrics.lab.kv.ground_truth import GroundTruth, PrefixDigestCache
from kvmetrics.lab.kv.store import HostKVStore
from kvmetrics.lab.kv.verify import Finding, ReadSpan, VerifySelector, findings_from_mask

DEVICES = available_devices()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so NaN payloads compare too."""
    return t.cpu().contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


# -- ground truth ------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shape_dtype_range_and_repeatability(device: str, dtype: torch.dtype) -> None:
    ids = list(range(100, 140))
    kv = GroundTruth(kv_dim=8, dtype=dtype, device=device, seed=1).kv(ids)
    assert kv.shape == (40, 8) and kv.dtype == dtype and kv.device.type == device
    assert not kv.isnan().any() and kv.min() >= -1 and kv.max() <= 1
    again = GroundTruth(kv_dim=8, dtype=dtype, device=device, seed=1).kv(ids)
    assert torch.equal(_bits(kv), _bits(again))
    other_seed = GroundTruth(kv_dim=8, dtype=dtype, device=device, seed=2).kv(ids)
    assert not torch.equal(kv, other_seed)


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_and_device_agree(device: str) -> None:
    ids = list(range(64))
    assert torch.equal(GroundTruth(device=device).kv(ids).cpu(), GroundTruth().kv(ids))


def test_kv_depends_on_the_whole_prefix() -> None:
    truth = GroundTruth(kv_dim=8)
    a = [5, 6, 7, 8, 1, 2, 3, 4]
    b = [9, 6, 7, 8, 1, 2, 3, 4]  # differs only in the first token
    ka, kb = truth.kv(a), truth.kv(b)
    # Every row differs (and in every dimension): a block of the same four tokens
    # cached for one prefix cannot verify for the other.
    assert (ka != kb).all()
    # Same tokens at other positions give other KV (positions count).
    assert not torch.equal(truth.kv([1, 2, 3, 4]), ka[4:])
    # Reordering the prefix changes the digest too.
    assert (truth.kv([6, 5, 7, 8]) != ka[:4])[1:].all()


def test_kv_is_causal() -> None:
    truth = GroundTruth()
    a = list(range(20))
    b = a[:12] + [999] * 8
    ka, kb = truth.kv(a), truth.kv(b)
    assert torch.equal(ka[:12], kb[:12])
    assert (ka[12:] != kb[12:]).any(dim=1).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_token_difference_is_visible_in_low_precision(dtype: torch.dtype) -> None:
    truth = GroundTruth(kv_dim=8, dtype=dtype)
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(50_000) for _ in range(16)]
        other = list(ids)
        other[rng.randrange(16)] ^= 1
        first = min(i for i in range(16) if ids[i] != other[i])
        assert (truth.kv(ids)[first:] != truth.kv(other)[first:]).any(dim=1).all()


def test_incremental_digests_match_a_full_computation() -> None:
    rng = random.Random(3)
    sequences = {f"r{i}": [rng.randrange(50_000) for _ in range(rng.randint(1, 90))]
                 for i in range(8)}
    calls: list[tuple[str, int, int]] = []

    def tokens(rid: str, start: int, end: int) -> list[int]:
        calls.append((rid, start, end))
        return sequences[rid][start:end]

    truth = GroundTruth()
    cache = PrefixDigestCache(truth, tokens)
    for rid, ids in sequences.items():
        end = 0
        while end < len(ids):
            end = min(len(ids), end + rng.randint(1, 17))
            cache.get(rid, end)
            cache.get(rid, rng.randint(0, end))  # re-reading a shorter prefix is free
        assert torch.equal(truth.kv_from_digests(cache.get(rid, len(ids))), truth.kv(ids))
    # Each token was fetched exactly once.
    fetched = {rid: 0 for rid in sequences}
    for rid, start, end in calls:
        fetched[rid] += end - start
    assert fetched == {rid: len(ids) for rid, ids in sequences.items()}
    cache.drop("r0")
    assert len(cache) == len(sequences) - 1


def test_short_token_source_is_an_error() -> None:
    cache = PrefixDigestCache(GroundTruth(), lambda rid, start, end: [1])
    with pytest.raises(ValueError, match="expected 3"):
        cache.get("r", 3)


def test_bad_kv_dim() -> None:
    with pytest.raises(ValueError, match="kv_dim"):
        GroundTruth(kv_dim=0)


# -- device and dtype ------------------------------------------------------------------------


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="auto"):
        resolve_device("tpu")
    if torch.cuda.is_available():
        assert resolve_device("cuda").type == "cuda"
        with pytest.raises(ValueError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ValueError, match="no CUDA device is available"):
            resolve_device("cuda")


def test_resolve_dtype() -> None:
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("BFloat16") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16
    for bad in ("int8", torch.float64):
        with pytest.raises(ValueError, match="KV dtype"):
            resolve_dtype(bad)


# -- cache, store, copies --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_cache_starts_poisoned_and_indexes_tokens_through_blocks(device: str) -> None:
    cache = KVCache(num_blocks=6, block_size=4, kv_dim=3, device=device)
    assert cache.data.isnan().all()
    table = torch.tensor([5, 2, 3])
    positions = torch.arange(0, 10)
    slots = token_slots(table, positions, 4).to(device)
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 12, 13]
    values = torch.arange(30, dtype=torch.float32, device=device).view(10, 3)
    before = cache.checksum()
    cache.write_tokens(slots, values)
    assert torch.equal(cache.read_tokens(slots), values)
    assert torch.equal(cache.data[5].view(-1), values[:4].reshape(-1))
    cache.poison_blocks(torch.tensor([2]))
    assert cache.read_tokens(slots)[4:8].isnan().all() and not cache.data[5].isnan().any()
    assert cache.checksum() != before


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 8), (1, 3)])  # (1, 3): 12- and 6-byte rows
def test_block_copier_is_bit_exact(device: str, dtype: torch.dtype,
                                   shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(32, *shape, generator=gen).to(dtype)
    src.view(-1)[5] = float("nan")
    src.view(-1)[7:9] = float("inf")
    dst = torch.zeros(20, *shape, dtype=dtype, device=device)
    src_ids = torch.randperm(32, generator=gen)[:13]
    dst_ids = torch.randperm(19, generator=gen)[:13] + 1
    copier = BlockCopier(torch.device(device), chunk_bytes=40)  # several chunks
    copier.copy(dst, dst_ids, src, src_ids)
    expected = torch.zeros(20, *shape, dtype=dtype)
    expected[dst_ids] = src[src_ids]
    assert torch.equal(_bits(dst), _bits(expected))
    gathered = copier.gather(src, src_ids)
    assert gathered.device.type == device and torch.equal(_bits(gathered), _bits(src[src_ids]))
    copier.copy(dst, torch.tensor([], dtype=torch.int64), src, torch.tensor([], dtype=torch.int64))


def test_row_view_uses_wide_rows_when_it_can() -> None:
    assert row_view(torch.zeros(5, 4, 8)).dtype == torch.complex128
    assert row_view(torch.zeros(5, 4, 3)).dtype == torch.complex128  # 48-byte rows
    assert row_view(torch.zeros(5, 1, 3)).dtype == torch.int32
    assert row_view(torch.zeros(5, 1, 3, dtype=torch.float16)).dtype == torch.int16
    assert row_view(torch.zeros(5, 4, 8), wide=False).shape == (5, 32)


@pytest.mark.parametrize("device", DEVICES)
def test_host_store_holds_slots_of_the_index(device: str) -> None:
    index = ExternalStoreIndex(3)
    store = HostKVStore(index, block_size=2, kv_dim=4, pin_memory=device == "cuda")
    assert store.data.shape == (3, 2, 4) and store.data.device.type == "cpu"
    assert store.data.is_pinned() == (device == "cuda") and store.data.isnan().all()
    slot = index.insert(b"h")
    blocks = torch.ones(1, 2, 4, device=device)
    store.scatter(torch.tensor([slot]), blocks)
    assert torch.equal(store.data[slot], blocks[0].cpu()) and store.capacity == 3
    assert tensor_digest(store.data) == store.checksum()


# -- verifier plumbing -----------------------------------------------------------------------


def test_findings_group_bad_rows_by_block() -> None:
    spans = [ReadSpan("a", [7, 3], 6), ReadSpan("b", [4, 9, 2], 9)]
    ok = torch.ones(15, dtype=torch.bool)
    ok[[1, 2, 4, 7, 14]] = False  # a: 1,2 (#0), 4 (#1); b: 1 (#0), 8 (#2)
    found = findings_from_mask(ok, spans, 4, step=9)
    assert found == [Finding("a", 7, 0, 1, 3, 9), Finding("a", 3, 1, 4, 5, 9),
                     Finding("b", 4, 0, 1, 2, 9), Finding("b", 2, 2, 8, 9, 9)]
    assert "request 'a'" in str(found[0])
    assert findings_from_mask(torch.ones(15, dtype=torch.bool), spans, 4, 1) == []


def test_sampled_selection_is_deterministic_and_roughly_fair() -> None:
    pick = VerifySelector("sampled", 0.25, seed=4)
    chosen = [pick(step, f"r{i}") for step in range(40) for i in range(25)]
    assert chosen == [VerifySelector("sampled", 0.25, seed=4)(step, f"r{i}")
                      for step in range(40) for i in range(25)]
    assert 0.18 < sum(chosen) / len(chosen) < 0.32
    assert all(VerifySelector("full")(1, "x") for _ in range(3))
    assert not VerifySelector("off")(1, "x")
    with pytest.raises(ValueError, match="fraction"):
        VerifySelector("sampled", 1.5)
