"""Stand-ins for the helpers of vLLM's ``tests/v1/kv_connector/unit/utils.py``.

docs/vllm-defects.md gives each defect's reproduction as a pytest written for
vLLM's own test folder (``from .utils import create_vllm_config, ...``). To run
those exact functions here, this module offers helpers with the same names and
parameters, written for this machine: the model config is a local folder (no
download), and ``MockKVConnector`` is the canaries' scripted connector (the
reproductions replace its ``get_num_new_matched_tokens`` anyway, as vLLM's tests
do). ``SCHEDULERS`` chooses the classes ``create_scheduler`` builds, so that a
reproduction can be run on a patched scheduler.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvmetrics.integrations.vllm_lab import builder, canaries
from kvmetrics.integrations.vllm_lab.compat import cpu_config_context, runner_output

#: (synchronous, async) scheduler classes that create_scheduler builds.
SCHEDULERS: tuple[type, type] = (Scheduler, AsyncScheduler)
_CONNECTORS = {"MockKVConnector": (canaries.ScriptedConnector.__name__,
                                     canaries.ScriptedConnector.__module__)}


def create_vllm_config(max_num_seqs: int = 16, max_num_batched_tokens: int = 64,
                       block_size: int = 16, max_model_len: int = 10000,
                       kv_connector_extra_config: dict[str, Any] | None = None,
                       kv_load_failure_policy: str = "fail",
                       kv_connector: str = "MockKVConnector",
                       kv_role: str = "kv_consumer") -> VllmConfig:
    name, module = _CONNECTORS[kv_connector]
    scheduler_config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=max_model_len, is_encoder_decoder=False)
    with cpu_config_context():
        return VllmConfig(
            model_config=ModelConfig(model=builder.model_dir(max_model_len),
                                     skip_tokenizer_init=True, max_model_len=max_model_len,
                                     dtype="float32", seed=42),
            scheduler_config=scheduler_config,
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector=name, kv_connector_module_path=module, kv_role=kv_role,
                kv_connector_extra_config=kv_connector_extra_config or {},
                kv_load_failure_policy=kv_load_failure_policy),
            device_config=DeviceConfig("cpu"),
        )


def create_scheduler(vllm_config: VllmConfig, num_blocks: int = 10000) -> Any:
    block_size = vllm_config.cache_config.block_size
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                             dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    sync_cls, async_cls = SCHEDULERS
    cls = async_cls if vllm_config.scheduler_config.async_scheduling else sync_cls
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
               structured_output_manager=StructuredOutputManager(vllm_config),
               block_size=block_size)


def create_request(request_id: int, num_tokens: int = 10, common_prefix_len: int = 0,
                   max_tokens: int = 16, block_size: int = 16) -> Request:
    """Prompt: ``common_prefix_len`` ones, then ``i * request_id`` (vLLM's recipe)."""
    init_none_hash(sha256)
    prompt = [1] * common_prefix_len + [i * request_id
                                        for i in range(num_tokens - common_prefix_len)]
    return Request(request_id=f"id-{request_id}", prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_tokens=max_tokens), pooling_params=None,
                   block_hasher=get_request_block_hasher(block_size, sha256))


def create_model_runner_output(reqs: list[Request], finished_recving: set[str] | None = None,
                               invalid_block_ids: set[int] | None = None,
                               token_id: int = 0) -> ModelRunnerOutput:
    req_ids = [r.request_id for r in reqs]
    kv_out = None
    if finished_recving is not None or invalid_block_ids is not None:
        kv_out = KVConnectorOutput(finished_recving=finished_recving,
                                   invalid_block_ids=invalid_block_ids or set())
    return runner_output(req_ids=req_ids, sampled_token_ids=[[token_id] for _ in req_ids],
                         kv_connector_output=kv_out)
