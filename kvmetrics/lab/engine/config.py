"""How a reference scheduler is configured, and the limits a request must fit in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POLICIES = ("recompute", "fail")
ACCOUNTINGS = ("unified", "historical")
ASYNC_ADMISSIONS = ("live", "vllm")
ASYNC_ROLLBACKS = ("drop", "vllm")
ASYNC_CACHINGS = ("in_flight", "placeholders")
RECOVERIES = ("vllm", "evict")

#: The async modes that go with each recovery: ``vllm`` is vLLM 0.33 as it is (its
#: stall and its in-flight rollback included), ``evict`` the complete fix (what
#: vLLM's scheduler does with kvmetrics' protective mode on).
RECOVERY_MODES: dict[str, dict[str, Any]] = {
    "vllm": {"async_admission": "vllm", "async_rollback": "vllm"},
    "evict": {"async_admission": "live", "async_rollback": "drop"},
}


def check_fits(request_id: str, num_prompt_tokens: int, max_tokens: int,
               config: SchedulerConfig) -> None:
    """Refuse a request that could never run to its end (any engine, same rule).

    Its last sampled token is never computed, so it needs the blocks of
    ``prompt + max_tokens - 1`` tokens; a request needing more than the pool holds
    could never be scheduled and the engine would spin forever.
    """
    if num_prompt_tokens < 1:
        raise ValueError(f"request {request_id!r} has an empty prompt")
    if num_prompt_tokens + max_tokens > config.max_model_len:
        raise ValueError(
            f"request {request_id!r} needs {num_prompt_tokens} prompt + {max_tokens} output "
            f"tokens, more than max_model_len {config.max_model_len}")
    need = -(-(num_prompt_tokens + max_tokens - 1) // config.block_size)
    if need > config.num_gpu_blocks - 1:
        raise ValueError(
            f"request {request_id!r} needs up to {need} KV blocks of {config.block_size} "
            f"tokens, more than the {config.num_gpu_blocks - 1} usable blocks of the cache")


class ConfigError(ValueError):
    """An impossible scheduler configuration; the message names the field."""


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    num_gpu_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    #: What happens to a request whose KV load failed: recompute the lost tokens
    #: or finish it with an error (vLLM's default since #34896 is "fail").
    kv_load_failure_policy: str = "recompute"
    #: "unified" counts events; "historical" keeps the old request fields and
    #: formulas so the old negative increments can be reproduced on purpose.
    accounting: str = "unified"
    #: How an async load whose every block failed is admitted again.
    #: ``live`` (default): it leaves the in-flight prefills (it holds nothing to
    #: finish any more) and waits behind the requests that hold blocks.
    #: ``vllm``: exactly vLLM 0.33, where it keeps reserving its own blocks at the head
    #: of the queue of block holders and can stall the engine for good
    #: (docs/vllm-defects.md, ``async-load-stall``).
    async_admission: str = "live"
    #: ``vllm``: vLLM 0.33's recovery path exactly. ``evict``: the fix for the stale
    #: reads it allows: every request that read a failed block is rolled back to it,
    #: and its blocks from there on leave the prefix cache under both policies
    #: (see kvmetrics.lab.engine.recovery and docs/vllm-defects.md).
    recovery: str = "vllm"
    #: vLLM's ``--async-scheduling`` (its default on GPUs): the engine schedules step
    #: n+1 before it processes step n's output (a batch queue of two), decode steps
    #: count their sampled token as a placeholder, and with a KV connector freed
    #: blocks return to the pool only once no step in flight can still write them.
    async_scheduling: bool = False
    #: What a rollback does to a step already in flight (async scheduling only).
    #: ``drop`` (default): its output is discarded and its placeholders cleared, as a
    #: preemption does. ``vllm``: vLLM 0.33, which keeps both (upstream #45138): the
    #: request runs one token ahead and keeps a token sampled over the failed block.
    async_rollback: str = "drop"
    #: Under async scheduling blocks are cached once an output is known, up to the
    #: computed tokens less those ``in_flight`` (vLLM 0.33) or less the request's
    #: outstanding ``placeholders`` (vLLM 0.32). The two differ only while a
    #: placeholder outlives its step (vLLM's rollback defect).
    async_caching: str = "in_flight"
    #: vLLM's ``scheduler_reserve_full_isl`` (on by default): a waiting request is
    #: admitted only if blocks for all its known tokens fit, not just its first chunk.
    reserve_full_prompt: bool = True
    #: vLLM's ``long_prefill_token_threshold`` (0: off, its default): no request gets
    #: more than this many tokens in a step while another request is running or waiting.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_gpu_blocks < 2:
            raise ConfigError("num_gpu_blocks must be at least 2 (block 0 is reserved)")
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold must be an integer >= 0, "
                              f"got {threshold!r}")
        for name, allowed in _CHOICES:
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {value!r}")


#: Fields with a fixed set of values, checked in this order.
_CHOICES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kv_load_failure_policy", POLICIES), ("async_admission", ASYNC_ADMISSIONS),
    ("async_rollback", ASYNC_ROLLBACKS), ("async_caching", ASYNC_CACHINGS),
    ("recovery", RECOVERIES), ("accounting", ACCOUNTINGS),
)
