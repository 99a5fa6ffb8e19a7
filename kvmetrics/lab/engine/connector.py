"""The KV connector contract (vLLM's, scheduler side) and the built-in store connector."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.hashing import BlockHash
from kvmetrics.lab.engine.outputs import LoadSpec
from kvmetrics.lab.engine.request import Request

LOAD_MODES = ("sync", "async", "mixed")


class KVConnector(Protocol):
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the connector can load, and whether
        the load is asynchronous. ``None`` means "ask again later"."""
        ...

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None: ...

    def take_loads(self) -> list[LoadSpec]:
        """Loads to start in the step being scheduled (consumed by the model runner)."""
        ...

    def request_finished(self, request: Request) -> None: ...


def choose_load_mode(mode: str, request_id: str, seed: int = 0) -> str:
    """Resolve ``mixed`` to sync or async per request, deterministically."""
    if mode != "mixed":
        return mode
    digest = hashlib.blake2b(f"{seed}|{request_id}".encode(), digest_size=1).digest()
    return "async" if digest[0] & 1 else "sync"


def stored_run(block_hashes: Sequence[BlockHash], start: int, limit: int,
               store: ExternalStoreIndex) -> int:
    """How many blocks from ``start`` (up to ``limit``) the store holds without a gap.

    ``limit`` is the number of full blocks before the last token, which a request
    always computes itself (so it can sample); every store connector matches so.
    """
    n = 0
    while start + n < limit and block_hashes[start + n] in store:
        n += 1
    return n


class StoreConnector:
    """Offers the longest run of a request's next full blocks found in the store.

    Like vLLM's offloading connectors it never offers the last prompt token: a
    request always computes at least one token so that it can sample.
    """

    def __init__(self, store: ExternalStoreIndex, block_size: int, mode: str = "sync",
                 seed: int = 0) -> None:
        if mode not in LOAD_MODES:
            raise ValueError(f"load mode must be one of {LOAD_MODES}, got {mode!r}")
        self.store = store
        self.block_size = block_size
        self.mode = mode
        self.seed = seed
        self._pending: dict[str, tuple[int, bool]] = {}
        self._loads: list[LoadSpec] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        bs = self.block_size
        start = num_computed_tokens // bs
        n = stored_run(request.block_hashes, start, (request.num_tokens - 1) // bs, self.store)
        if n == 0:
            return 0, False
        is_async = choose_load_mode(self.mode, request.request_id, self.seed) == "async"
        self._pending[request.request_id] = (start, is_async)
        return n * bs, is_async

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        pending = self._pending.pop(request.request_id, None)
        if num_external_tokens <= 0 or pending is None:
            return
        first, is_async = pending
        n = num_external_tokens // self.block_size
        for h in request.block_hashes[first:first + n]:
            self.store.lookup(h)  # a hit refreshes its recency in the store
        self._loads.append(LoadSpec(
            request.request_id, "async" if is_async else "sync", first,
            tuple(block_ids[first:first + n]), tuple(request.block_hashes[first:first + n])))

    def take_loads(self) -> list[LoadSpec]:
        loads, self._loads = self._loads, []
        return loads

    def request_finished(self, request: Request) -> None:
        self._pending.pop(request.request_id, None)
