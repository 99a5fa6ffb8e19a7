"""Fixed pool of KV blocks with reference counts, an LRU free queue and the prefix cache.

Free blocks that still carry a hash stay in the prefix cache until they are
handed out again: that reuse is an eviction with cause ``capacity``. Block 0 is a
reserved null block, as in vLLM, so block ids and free counts line up with vLLM's
scheduler in differential runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvmetrics.lab.engine.hashing import BlockHash


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the front, append and removal.

    The front holds the least recently freed block, which is evicted first;
    a prefix-cache hit on a free block removes it from the middle.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.size = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.size -= 1

    def prepend_n(self, blocks: list[KVBlock]) -> None:
        """Put blocks at the front, in order: the first is handed out first."""
        for block in reversed(blocks):
            first = self._head.next_free
            assert first is not None
            block.prev_free = self._head
            block.next_free = first
            first.prev_free = block
            self._head.next_free = block
            self.size += 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.size += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("the block pool needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed, never handed out
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[BlockHash, dict[int, KVBlock]] = {}
        #: Evictions by cause since the scheduler last drained them into events.
        self.evictions: dict[str, int] = {"capacity": 0, "kv_load_failure": 0, "reset": 0}
        #: Blocks held by at least one request, counted on 0<->1 reference changes,
        #: independently of the free queue so the pool invariant checks something.
        self.num_used_blocks = 0
        #: Reference drops below zero seen so far (always 0 unless there is a bug).
        self.negative_ref_counts = 0

    # -- prefix cache -------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        entry = self.cached.get(block_hash)
        if not entry:
            return None
        return next(iter(entry.values()))

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, {})[block.block_id] = block

    def _uncache(self, block: KVBlock, cause: str) -> bool:
        block_hash = block.block_hash
        if block_hash is None:
            return False
        entry = self.cached.get(block_hash)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self.cached[block_hash]
        block.block_hash = None
        self.evictions[cause] += 1
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> int:
        """Drop blocks from the prefix cache (a failed load); owners keep them."""
        return sum(self._uncache(self.blocks[b], "kv_load_failure") for b in block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed while no request holds a block."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks[1:]:
            self._uncache(block, "reset")
        return True

    # -- allocation ---------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.free_queue.size:
            raise ValueError(f"asked for {n} blocks, {self.free_queue.size} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._uncache(block, "capacity")
            block.ref_cnt = 1
            self.num_used_blocks += 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_used_blocks += 1
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference each, ``ordered`` by eviction priority.

        As in vLLM, freed blocks without a hash can never be hit, so they go to
        the front for immediate reuse; hashed blocks go to the back, keeping the
        prefix cache in LRU order.
        """
        reuse_first: list[KVBlock] = []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.num_used_blocks -= 1
                if block.block_hash is None:
                    reuse_first.append(block)
                else:
                    self.free_queue.append(block)
            elif block.ref_cnt < 0:
                self.negative_ref_counts += 1
        self.free_queue.prepend_n(reuse_first)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.size

    def usage(self) -> float:
        usable = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / usable
