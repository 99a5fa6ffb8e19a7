"""Chained block hashes and the prompt token sources they are computed from."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvmetrics.lab.engine.hashing import ROOT_HASH, hash_block
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.tokens import VOCAB_SIZE, BlockSeededTokens, ExplicitTokens
from tests.helpers.engine import block_hashes, make_request


def _hashes(request: Request, block_size: int) -> list[bytes]:
    request.update_block_hashes(block_size)
    return list(request.block_hashes)


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(list(range(47)), 16)) == 2
    assert len(block_hashes(list(range(48)), 16)) == 3


def test_block_hash_depends_on_the_whole_prefix() -> None:
    shared_tail = list(range(500, 516))
    a = block_hashes(list(range(0, 16)) + shared_tail)
    b = block_hashes(list(range(100, 116)) + shared_tail)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens, different parent
    c = block_hashes(list(range(0, 16)) + shared_tail + list(range(900, 916)))
    assert c[:2] == a  # equal prefixes, equal hashes


def test_cache_salt_changes_every_block_and_equal_salts_share() -> None:
    ids = list(range(64))
    plain = _hashes(make_request("p", ids), 16)
    salted = _hashes(make_request("s", ids, cache_salt="tenant-a"), 16)
    again = _hashes(make_request("t", ids, cache_salt="tenant-a"), 16)
    other = _hashes(make_request("u", ids, cache_salt="tenant-b"), 16)
    assert all(p != s for p, s in zip(plain, salted, strict=True))
    assert salted == again
    assert all(s != o for s, o in zip(salted, other, strict=True))


def test_extra_key_cannot_be_confused_with_token_content() -> None:
    assert hash_block(ROOT_HASH, b"yz", b"x") != hash_block(ROOT_HASH, b"z", b"xy")
    assert hash_block(ROOT_HASH, b"xyz") != hash_block(ROOT_HASH, b"yz", b"x")


def test_output_tokens_extend_the_chain() -> None:
    r = make_request("r", list(range(20)), max_tokens=20)
    r.update_block_hashes(16)
    assert len(r.block_hashes) == 1
    r.output_token_ids.extend(range(1000, 1012))
    r.update_block_hashes(16)
    explicit = block_hashes(list(range(20)) + list(range(1000, 1012)))
    assert len(r.block_hashes) == 2
    # Prompt and output tokens are keyed apart, so the second block differs from a
    # prompt holding the same ids; the first, all prompt, is the same.
    assert r.block_hashes[0] == explicit[0]
    assert r.token_ids(0, 32) == list(range(20)) + list(range(1000, 1012))


_CHILD = """
import sys
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.engine.tokens import BlockSeededTokens, ExplicitTokens
for r in (Request("a", ExplicitTokens(range(0, 80)), 1, cache_salt="s"),
          Request("b", BlockSeededTokens([7, 11, 13], 1100, unit=512), 1)):
    r.update_block_hashes(16)
    sys.stdout.write(",".join(h.hex() for h in r.block_hashes) + "\\n")
"""


def test_hashes_are_identical_in_another_process() -> None:
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                         text=True, check=True, timeout=60).stdout.splitlines()
    here = []
    for r in (Request("a", ExplicitTokens(range(0, 80)), 1, cache_salt="s"),
              Request("b", BlockSeededTokens([7, 11, 13], 1100, unit=512), 1)):
        here.append(",".join(h.hex() for h in _hashes(r, 16)))
    assert out == here
    assert len(out[1].split(",")) == 1100 // 16


# -- BlockSeededTokens -------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 64, 512])
def test_block_seeded_prompts_sharing_unit_ids_share_blocks_at_any_block_size(
    block_size: int,
) -> None:
    a = Request("a", BlockSeededTokens([7, 11, 13], 1536, unit=512), 1)
    b = Request("b", BlockSeededTokens([7, 11, 99], 1536, unit=512), 1)
    ha, hb = _hashes(a, block_size), _hashes(b, block_size)
    shared = 1024 // block_size
    assert ha[:shared] == hb[:shared]
    assert ha[shared] != hb[shared]
    assert a.prompt.tokens(0, 1024) == b.prompt.tokens(0, 1024)
    assert a.prompt.tokens(1024, 1536) != b.prompt.tokens(1024, 1536)


def test_block_seeded_content_keys_match_iff_tokens_match_across_unit_boundaries() -> None:
    # Unit 24 with engine blocks of 16: block 1 (tokens 16..32) spans two units.
    a = BlockSeededTokens([5, 6, 8], 70, unit=24)
    b = BlockSeededTokens([5, 7, 8], 70, unit=24)
    assert a.content_key(0, 16) == b.content_key(0, 16)
    assert a.tokens(0, 16) == b.tokens(0, 16)
    assert a.content_key(16, 32) != b.content_key(16, 32)
    assert a.tokens(16, 32) != b.tokens(16, 32)
    # Unit 8 is shared again, but the chain through block 1 differs.
    ra, rb = Request("a", a, 1), Request("b", b, 1)
    assert _hashes(ra, 16)[2:] != _hashes(rb, 16)[2:]


def test_block_seeded_tokens_are_in_vocabulary_and_length_is_checked() -> None:
    t = BlockSeededTokens([1, 2], 600, unit=512)
    assert len(t) == 600
    assert all(0 <= x < VOCAB_SIZE for x in t.tokens(0, 600))
    with pytest.raises(ValueError, match="cannot hold 1100 tokens"):
        BlockSeededTokens([1, 2], 1100, unit=512)
    with pytest.raises(ValueError, match="cannot hold 500 tokens"):
        BlockSeededTokens([1, 2], 500, unit=512)  # the last unit would be empty


def test_explicit_tokens_content_keys() -> None:
    t = ExplicitTokens([3, 1, 4, 1, 5, 9, 2, 6])
    assert t.content_key(0, 2) != t.content_key(2, 4)
    assert t.content_key(1, 2) == t.content_key(3, 4)  # both hold [1]
    assert t.tokens(2, 5) == [4, 1, 5]
