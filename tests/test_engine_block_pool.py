"""BlockPool: reference counts, the LRU free queue, the prefix cache and eviction causes."""

from __future__ import annotations

import pytest

from kvmetrics.lab.engine.block_pool import BlockPool, KVBlock


def _h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def _cached(pool: BlockPool, *blocks: KVBlock) -> None:
    for block in blocks:
        pool.cache_block(block, _h(block.block_id))


def test_new_pool_hands_out_every_block_but_the_null_block_in_id_order() -> None:
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5
    assert _ids(pool.get_new_blocks(5)) == [1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 0
    assert pool.num_used_blocks == 5
    with pytest.raises(ValueError, match="asked for 1 blocks, 0 free"):
        pool.get_new_blocks(1)


def test_pool_needs_room_for_the_null_block() -> None:
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_freed_blocks_without_hash_are_reused_first_and_cached_ones_in_lru_order() -> None:
    # vLLM's order: a block without a hash can never be hit, so it goes to the front;
    # a cached block goes to the back, so the prefix cache is evicted LRU.
    pool = BlockPool(7)
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    _cached(pool, b1, b2)
    pool.free_blocks([b2, b1])
    pool.free_blocks([b4, b3])
    assert _ids(list(pool.free_queue)) == [4, 3, 5, 6, 2, 1]
    assert _ids(pool.get_new_blocks(6)) == [4, 3, 5, 6, 2, 1]
    assert pool.evictions["capacity"] == 2


def test_reusing_a_cached_free_block_counts_one_capacity_eviction() -> None:
    pool = BlockPool(4)
    b1, b2, b3 = pool.get_new_blocks(3)
    _cached(pool, b1, b3)
    pool.free_blocks([b1, b2, b3])

    assert pool.get_cached_block(_h(1)) is b1  # a free block stays in the prefix cache
    reused = pool.get_new_blocks(2)  # b2 (never cached) then b1 (least recent cached)
    assert reused == [b2, b1]
    assert pool.evictions == {"capacity": 1, "kv_load_failure": 0, "reset": 0}
    assert pool.get_cached_block(_h(1)) is None
    assert b1.block_hash is None
    assert pool.get_cached_block(_h(3)) is b3


def test_touching_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(4)
    b1, b2 = pool.get_new_blocks(2)
    _cached(pool, b1)
    pool.free_blocks([b1])
    assert pool.num_free_blocks == 2 and pool.num_used_blocks == 1

    pool.touch([b1])  # a prefix-cache hit on a free block
    assert b1.ref_cnt == 1
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 2
    assert b1 not in list(pool.free_queue)
    assert pool.evictions["capacity"] == 0  # a hit is not an eviction

    pool.touch([b2])  # a hit on a block in use only adds a reference
    assert b2.ref_cnt == 2
    assert pool.num_used_blocks == 2

    pool.free_blocks([b2])
    assert b2.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([b1, b2])  # b2 has no hash: front; b1 is cached: back
    assert _ids(list(pool.free_queue)) == [2, 3, 1]
    assert pool.num_used_blocks == 0


def test_evict_blocks_drops_hashes_but_owners_keep_their_blocks() -> None:
    pool = BlockPool(5)
    b1, b2, b3 = pool.get_new_blocks(3)
    _cached(pool, b1, b2)

    assert pool.evict_blocks([2, 3]) == 1  # b3 was never cached
    assert pool.get_cached_block(_h(2)) is None
    assert pool.get_cached_block(_h(1)) is b1
    assert b2.ref_cnt == 1 and pool.num_used_blocks == 3
    assert pool.evictions == {"capacity": 0, "kv_load_failure": 1, "reset": 0}
    assert pool.evict_blocks([2]) == 0  # already gone: not counted twice


def test_reset_prefix_cache_only_when_no_request_holds_a_block() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    _cached(pool, *blocks)

    pool.free_blocks(blocks[:2])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(_h(1)) is blocks[0]
    assert pool.evictions["reset"] == 0

    pool.free_blocks(blocks[2:])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert pool.evictions == {"capacity": 0, "kv_load_failure": 0, "reset": 3}
    assert pool.get_new_blocks(4) and pool.evictions["capacity"] == 0


def test_two_blocks_with_one_hash_are_both_cached_until_each_is_evicted() -> None:
    pool = BlockPool(4)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, _h(7))
    pool.cache_block(b2, _h(7))
    pool.cache_block(b1, _h(8))  # a cached block keeps its first hash
    assert b1.block_hash == _h(7)

    assert pool.evict_blocks([1]) == 1
    assert pool.get_cached_block(_h(7)) is b2
    assert pool.evict_blocks([2]) == 1
    assert pool.get_cached_block(_h(7)) is None
    assert pool.cached == {}


def test_freeing_a_free_block_is_counted_as_a_negative_reference() -> None:
    pool = BlockPool(3)
    (b1,) = pool.get_new_blocks(1)
    pool.free_blocks([b1])
    pool.free_blocks([b1])
    assert pool.negative_ref_counts == 1


def test_usage_is_the_share_of_usable_blocks_in_use() -> None:
    pool = BlockPool(5)
    assert pool.usage() == 0.0
    blocks = pool.get_new_blocks(3)
    assert pool.usage() == pytest.approx(0.75)
    pool.free_blocks(blocks)
    assert pool.usage() == 0.0
