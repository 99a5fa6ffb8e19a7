"""Per-request block tables on top of the block pool: lookups, allocation, caching, freeing."""

from __future__ import annotations

from kvmetrics.lab.engine.block_pool import BlockPool, KVBlock
from kvmetrics.lab.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True):
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[KVBlock]] = {}
        #: The same tables as block ids, kept in step so that a step's output can
        #: hand them out without copying (they grow by appends only).
        self.req_block_ids: dict[str, list[int]] = {}
        #: How many leading blocks of each request have been offered to the cache.
        self.num_cached_blocks: dict[str, int] = {}

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of leading full blocks found in the prefix cache.

        Capped at ``num_tokens - 1`` tokens: the last token is always computed so
        the request can sample its next token.
        """
        if not self.enable_prefix_caching:
            return [], 0
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        get = self.pool.get_cached_block
        for block_hash in request.block_hashes[:limit]:
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        reserved_blocks: int = 0,
        full_sequence_tokens: int = 0,
    ) -> list[KVBlock] | None:
        """Give the request room for its computed and new tokens; None if it does not fit.

        Blocks are offered to the prefix cache as soon as they are allocated for
        full blocks of known tokens (as vLLM does), unless caching is delayed until
        an async load lands. ``full_sequence_tokens`` is vLLM's admission gate
        (``scheduler_reserve_full_isl``): the blocks of that many tokens must fit in
        the free blocks first (``reserved_blocks`` is not taken off for it, as in vLLM).
        """
        bs = self.block_size
        hits = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        ids = self.req_block_ids.setdefault(request.request_id, [])
        computed = (request.num_computed_tokens + len(hits) * bs + num_external_computed_tokens)
        need = cdiv(computed + num_new_tokens, bs) - len(blocks) - len(hits)
        need = max(need, 0)
        # Hits sitting in the free queue stop being free once touched.
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        free = self.pool.num_free_blocks
        full_need = max(cdiv(full_sequence_tokens, bs) - len(blocks) - len(hits), 0)
        if (full_sequence_tokens and full_need + evictable_hits > free) \
                or need + evictable_hits > free - reserved_blocks:
            if not blocks:
                del self.req_blocks[request.request_id]
                del self.req_block_ids[request.request_id]
            return None
        if hits:
            self.pool.touch(hits)
            blocks.extend(hits)
            ids.extend(b.block_id for b in hits)
            self.num_cached_blocks[request.request_id] = (
                self.num_cached_blocks.get(request.request_id, 0) + len(hits))
        new = self.pool.get_new_blocks(need)
        blocks.extend(new)
        ids.extend(b.block_id for b in new)
        if not delay_cache_blocks:
            self.cache_blocks(request, min(computed + num_new_tokens, request.num_tokens))
        return new

    def remaining_blocks(self, request: Request, max_model_len: int) -> int:
        """Blocks the request still needs to hold its whole sequence."""
        full = cdiv(min(request.num_tokens, max_model_len), self.block_size)
        return max(0, full - len(self.req_blocks.get(request.request_id, ())))

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if not blocks:
            return
        done = self.num_cached_blocks.get(rid, 0)
        full = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(done, full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        if full > done:
            self.num_cached_blocks[rid] = full

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so its tail is evicted first."""
        blocks = self.pop_blocks(request)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def pop_blocks(self, request: Request) -> list[KVBlock]:
        """Forget a request's table and hand its blocks over without freeing them
        (a deferred free returns them to the pool later, tail first)."""
        self.req_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        return self.req_blocks.pop(request.request_id, None) or []

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids (a live list: copy it to keep it)."""
        return self.req_block_ids.get(request_id, [])
