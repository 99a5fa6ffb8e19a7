"""How the fault-injecting wrapper finds and configures the connector it wraps.

The wrapper's ``kv_connector_extra_config`` names the inner connector
(``inner_connector``, ``inner_module_path``) and holds the inner connector's own
settings (``inner_extra_config``). vLLM's connector factory, and every class-level
question vLLM asks, expect a transfer config naming one connector: these functions
rewrite the wrapper's config into the inner connector's, so the inner class is found
and built exactly as vLLM would find and build it if it were configured alone.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvmetrics.faults.fault_plan import FaultSettings, fail

__all__ = ["InnerOnly", "extra_config", "inner_class", "inner_transfer_config",
           "inner_vllm_config"]


def extra_config(kv_transfer_config: Any) -> Any:
    """The wrapper's ``kv_connector_extra_config`` (None where the config has none)."""
    return getattr(kv_transfer_config, "kv_connector_extra_config", None)


def inner_transfer_config(kv_transfer_config: Any, settings: FaultSettings) -> Any:
    """A copy of the wrapper's transfer config that names the inner connector."""
    return dataclasses.replace(
        kv_transfer_config, kv_connector=settings.inner_connector,
        kv_connector_module_path=settings.inner_module_path,
        kv_connector_extra_config=copy.deepcopy(settings.inner_extra_config))


def inner_vllm_config(vllm_config: Any, settings: FaultSettings) -> Any:
    """A shallow copy of vLLM's config whose transfer config names the inner connector."""
    inner = copy.copy(vllm_config)
    object.__setattr__(inner, "kv_transfer_config",
                       inner_transfer_config(vllm_config.kv_transfer_config, settings))
    return inner


@dataclass
class InnerOnly:
    """Just enough of a transfer config for the factory to find the inner class."""

    settings: FaultSettings

    @property
    def kv_connector(self) -> str:
        return self.settings.inner_connector

    @property
    def kv_connector_module_path(self) -> str | None:
        return self.settings.inner_module_path

    @property
    def kv_connector_extra_config(self) -> dict[str, Any]:
        return self.settings.inner_extra_config

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.settings.inner_extra_config.get(key, default)


def inner_class(kv_transfer_config: Any, settings: FaultSettings) -> type[KVConnectorBase_V1]:
    """The inner connector's class, for the wrapper's transfer config (or an
    :class:`InnerOnly`, which names the inner connector already); a
    :class:`~kvmetrics.faults.fault_plan.FaultConfigError` naming the key where vLLM's
    factory cannot load it or it is not a v1 connector."""
    config: Any = (kv_transfer_config if isinstance(kv_transfer_config, InnerOnly)
                   else inner_transfer_config(kv_transfer_config, settings))
    try:
        cls = KVConnectorFactory.get_connector_class(config)
    except Exception as e:
        key = "inner_module_path" if settings.inner_module_path else "inner_connector"
        raise fail(key, f"cannot load connector {settings.inner_connector!r}: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise fail("inner_connector", f"{settings.inner_connector!r} is not a v1 KV connector")
    return cls
