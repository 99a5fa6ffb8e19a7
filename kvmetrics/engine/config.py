"""How a reference scheduler is configured, and the limits a request must fit in."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("recompute", "fail")
ACCOUNTINGS = ("unified", "historical")
ASYNC_ADMISSIONS = ("live", "vllm")
RECOVERIES = ("vllm", "evict")


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
    #: How an async load's admission reserves blocks for prefills in flight.
    #: ``live`` (default): for the *other* prefills only, and a request whose async
    #: load failed in every block stops reserving until it is admitted again.
    #: ``vllm``: exactly vLLM 0.33, where such a request keeps reserving for itself
    #: at the head of the queue and can stall the engine for good (docs/vllm.md).
    async_admission: str = "live"
    #: ``vllm``: vLLM 0.33's recovery path exactly. ``evict``: also evict, under both
    #: policies, every affected request's blocks from its rollback point on (the fix
    #: for the stale reads vLLM's path allows; see kvmetrics.engine.recovery).
    recovery: str = "vllm"

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_gpu_blocks < 2:
            raise ConfigError("num_gpu_blocks must be at least 2 (block 0 is reserved)")
        if self.kv_load_failure_policy not in POLICIES:
            raise ConfigError(f"kv_load_failure_policy must be one of {POLICIES}, "
                              f"got {self.kv_load_failure_policy!r}")
        if self.async_admission not in ASYNC_ADMISSIONS:
            raise ConfigError(f"async_admission must be one of {ASYNC_ADMISSIONS}, "
                              f"got {self.async_admission!r}")
        if self.recovery not in RECOVERIES:
            raise ConfigError(f"recovery must be one of {RECOVERIES}, got {self.recovery!r}")
        if self.accounting not in ACCOUNTINGS:
            raise ConfigError(f"accounting must be one of {ACCOUNTINGS}, "
                              f"got {self.accounting!r}")

    @property
    def max_blocks_per_request(self) -> int:
        return -(-self.max_model_len // self.block_size)
