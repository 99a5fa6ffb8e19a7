"""Index of the external KV tier (host memory behind the built-in connector).

The index maps block hashes to slots with a capacity and LRU eviction. It holds
no KV itself: the data plane keeps one host tensor indexed by slot, so the same
index serves the pure engine and the torch data plane.
"""

from __future__ import annotations

from collections import OrderedDict

from kvmetrics.lab.engine.hashing import BlockHash


class ExternalStoreIndex:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("external store capacity must be at least 1 block")
        self.capacity = capacity_blocks
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        self._free_slots = list(range(capacity_blocks - 1, -1, -1))
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slots

    def lookup(self, block_hash: BlockHash) -> int | None:
        """Slot of a stored block, marking it recently used; None if absent."""
        slot = self._slots.get(block_hash)
        if slot is not None:
            self._slots.move_to_end(block_hash)
        return slot

    def insert(self, block_hash: BlockHash) -> int:
        """Slot to write a block into; evicts the least recently used block if full."""
        slot = self._slots.get(block_hash)
        if slot is not None:
            self._slots.move_to_end(block_hash)
            return slot
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            _, slot = self._slots.popitem(last=False)
            self.evictions += 1
        self._slots[block_hash] = slot
        return slot

    def discard(self, block_hash: BlockHash) -> None:
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._free_slots.append(slot)
