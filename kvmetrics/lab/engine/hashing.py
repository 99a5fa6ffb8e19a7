"""Chained hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, so equal hashes mean equal *prefixes*,
not just equal blocks; that is also why a failed block invalidates every block
after it. Hashes are blake2b digests of bytes, hence identical across processes
(Python's ``hash`` is salted per process).
"""

from __future__ import annotations

import hashlib

BlockHash = bytes

#: Parent of the first block of every request (vLLM calls it the "none hash").
ROOT_HASH: BlockHash = hashlib.blake2b(b"kvmetrics-root", digest_size=16).digest()


def hash_block(parent: BlockHash, content_key: bytes, extra_key: bytes = b"") -> BlockHash:
    """Hash one full block given its parent's hash and its token content key.

    ``extra_key`` carries whatever else makes KV differ for the same tokens (a
    cache salt on the first block, a LoRA id); it is length-prefixed so that it
    can never be confused with token content.
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(len(extra_key).to_bytes(4, "little"))
    h.update(extra_key)
    h.update(content_key)
    return h.digest()
