"""Build vLLM's real v1 scheduler on a CPU-only machine, without a model or weights.

vLLM's scheduler only needs a :class:`VllmConfig` and a :class:`KVCacheConfig`;
the model config only has to parse, so a temporary folder holding an OPT-style
``config.json`` and ``skip_tokenizer_init`` are enough. The parameters mirror
:class:`kvmetrics.lab.engine.scheduler.SchedulerConfig` so that one configuration can
drive both the reference engine and vLLM in a differential run.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.lab.vllm.compat import cpu_config_context

#: Import path of the built-in connector (vLLM imports it again by this name).
CONNECTOR_MODULE = "kvmetrics.lab.vllm.store_connector"
CONNECTOR_NAME = "KvmetricsStoreConnector"
INSTRUMENTED = "kvmetrics.vllm.scheduler.InstrumentedScheduler"
INSTRUMENTED_ASYNC = "kvmetrics.vllm.scheduler.InstrumentedAsyncScheduler"

# A tiny OPT config: only parsed, never instantiated, so the sizes are irrelevant
# except that they must be self-consistent.
_MODEL_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "word_embed_proj_dim": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 1,
    "ffn_dim": 128,
    "vocab_size": 50272,
    "torch_dtype": "float32",
}

_model_dirs: dict[int, str] = {}


def _remove_if_ours(path: str, owner_pid: int) -> None:
    """Remove a model folder at exit, in the process that made it only.

    A forked child inherits the exit handler; it must not delete the folder its
    parent is still using.
    """
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


def model_dir(max_position_embeddings: int) -> str:
    """A folder holding only a config.json, made once per process and length.

    It is removed when the process exits (one folder per process was left in the
    temporary directory before).
    """
    path = _model_dirs.get(max_position_embeddings)
    if path is None or not os.path.isdir(path):
        path = tempfile.mkdtemp(prefix="kvmetrics-vllm-model-")
        atexit.register(_remove_if_ours, path, os.getpid())
        cfg = dict(_MODEL_CONFIG, max_position_embeddings=max_position_embeddings)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        _model_dirs[max_position_embeddings] = path
    return path


@dataclass(frozen=True)
class ConnectorSpec:
    """The KV connector vLLM should instantiate (by module path and class name).

    ``extra`` becomes ``kv_connector_extra_config``; the built-in connector finds
    its shared store through ``extra["store_key"]``.
    """

    name: str = CONNECTOR_NAME
    module_path: str = CONNECTOR_MODULE
    extra: dict[str, Any] = field(default_factory=dict)


def build_vllm_config(
    config: SchedulerConfig,
    *,
    scheduler_cls: str | type | None = None,
    connector: ConnectorSpec | None = None,
    kvmetrics_settings: dict[str, Any] | None = None,
    scheduler_options: dict[str, Any] | None = None,
) -> Any:
    """A :class:`vllm.config.VllmConfig` equivalent to the reference ``config``.

    vLLM's own scheduler defaults are kept except where ``config`` says otherwise:
    ``scheduler_reserve_full_isl`` is ``config.reserve_full_prompt`` (both on by
    default), ``long_prefill_token_threshold`` and ``async_scheduling`` are
    copied. vLLM's CPU platform turns async scheduling off (nothing runs on a GPU
    here); it is set back afterwards, as on the GPU deployments this models, so
    that ``max_concurrent_batches`` is 2 and a ``kv_both`` connector defers block
    frees. ``kvmetrics_settings`` lands in ``additional_config["kvmetrics"]``,
    where the instrumented scheduler reads its settings (see
    :mod:`kvmetrics.vllm.exporting`); ``serve`` is ``engine`` unless they say
    otherwise, because a lab process builds many engines and the exporter process
    switches the prometheus-client of the process that starts it to files for good.
    ``scheduler_options`` are more of
    vLLM's own ``SchedulerConfig`` fields (e.g. 0.34's ``max_num_inflight_kv_loads``).
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        VllmConfig,
    )
    from vllm.config import SchedulerConfig as VllmSchedulerConfig

    model_config = ModelConfig(
        model=model_dir(max(config.max_model_len, 2048)),
        skip_tokenizer_init=True,
        max_model_len=config.max_model_len,
        dtype="float32",
        seed=0,
    )
    sched_kwargs: dict[str, Any] = dict(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        is_encoder_decoder=False,
        async_scheduling=config.async_scheduling,
        scheduler_reserve_full_isl=config.reserve_full_prompt,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
    )
    if scheduler_cls is not None:
        sched_kwargs["scheduler_cls"] = scheduler_cls
    sched_kwargs.update(scheduler_options or {})
    cache_config = CacheConfig(block_size=config.block_size,
                               enable_prefix_caching=config.enable_prefix_caching)
    kv_transfer = None
    if connector is not None:
        kv_transfer = KVTransferConfig(
            kv_connector=connector.name,
            kv_connector_module_path=connector.module_path,
            kv_role="kv_both",
            # arg-type: vLLM asks for the literal; the reference config holds one of the
            # same names (engine.config.POLICIES), checked when it is made.
            kv_load_failure_policy=config.kv_load_failure_policy,  # type: ignore[arg-type]
            kv_connector_extra_config=dict(connector.extra),
        )
    with cpu_config_context():
        vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=VllmSchedulerConfig(**sched_kwargs),
            cache_config=cache_config,
            kv_transfer_config=kv_transfer,
            device_config=DeviceConfig("cpu"),
            additional_config=({"kvmetrics": {"serve": "engine", **kvmetrics_settings}}
                               if kvmetrics_settings is not None else {}),
        )
    vllm_config.cache_config.num_gpu_blocks = config.num_gpu_blocks
    vllm_config.scheduler_config.async_scheduling = config.async_scheduling
    return vllm_config


def build_kv_cache_config(config: SchedulerConfig) -> Any:
    """One full-attention group of ``num_gpu_blocks`` blocks (no tensors: no worker)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=config.block_size, num_kv_heads=1, head_size=16,
                             dtype=torch.float32)
    return KVCacheConfig(num_blocks=config.num_gpu_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], spec)])


def build_scheduler(
    config: SchedulerConfig,
    *,
    scheduler_cls: str | type | None = None,
    connector: ConnectorSpec | None = None,
    log_stats: bool = True,
    kvmetrics_settings: dict[str, Any] | None = None,
    scheduler_options: dict[str, Any] | None = None,
) -> Any:
    """vLLM's scheduler (or ``scheduler_cls``) built the way EngineCore builds it."""
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config = build_vllm_config(config, scheduler_cls=scheduler_cls, connector=connector,
                                    kvmetrics_settings=kvmetrics_settings,
                                    scheduler_options=scheduler_options)
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=build_kv_cache_config(config),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=config.block_size,
        log_stats=log_stats,
    )


def instrumented_cls(config: SchedulerConfig) -> str:
    """The instrumented scheduler for ``config``: always the one class the README names,
    which builds itself over ``AsyncScheduler`` when vLLM decided async scheduling (so
    every async test goes through that choice, as ``vllm serve`` does)."""
    return INSTRUMENTED


def block_hasher_for(vllm_config: Any) -> Any:
    """vLLM's request block hasher for this config (after seeding the root hash)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(vllm_config.cache_config.block_size, hash_fn)
