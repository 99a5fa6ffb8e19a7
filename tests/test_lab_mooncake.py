"""Replaying the real Mooncake FAST'25 conversation trace."""

from __future__ import annotations

import json

from tests.lab_support import mooncake_trace, run_cli

REPLAY = ("run", "--trace-format", "mooncake", "--block-size", "512",
          "--max-num-seqs", "1", "--max-num-batched-tokens", "131072", "--max-tokens", "1",
          "--fault-rate", "0", "--store-blocks", "0", "--verify", "off", "--json")


def _replay(num_gpu_blocks: int, *extra: str) -> dict:
    result = run_cli(*REPLAY, "--trace", str(mooncake_trace()),
                     "--num-gpu-blocks", str(num_gpu_blocks), *extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_unbounded_cache_reaches_the_published_hit_ratio() -> None:
    summary = _replay(200_000)
    local = summary["prefix_cache"]["local"]
    assert round(local["hit_ratio"], 4) == 0.3734
    assert summary["requests"] == {"submitted": 12031, "finished": 12031, "failed": 0,
                                   "aborted": 0}
    assert summary["guard_rejected_increments"] == summary["invariant_violations"] == 0
    assert summary["evicted_blocks"]["capacity"] == 0


def test_hit_ratio_grows_with_cache_size() -> None:
    ratios = [_replay(blocks, "--max-requests", "3000")["prefix_cache"]["local"]["hit_ratio"]
              for blocks in (300, 1200, 4800, 200_000)]
    assert ratios == sorted(ratios)
    assert len(set(ratios)) == len(ratios), ratios
