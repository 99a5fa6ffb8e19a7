"""The fault-injecting KV connector: makes a chosen share of a real connector's loads fail.

For rehearsing recovery, dashboards and alerts in staging, and for the end-to-end tests;
named in ``--kv-transfer-config`` with ``"kv_connector_module_path":
"kvmetrics.faults.connector"``, so it is loaded into ``vllm serve`` (scheduler and
workers) only where a configuration asks for it. It injects and never counts: it may
import the engine-agnostic core (:mod:`kvmetrics.metrics`), vLLM and torch, never the
observer (:mod:`kvmetrics.vllm`, which runs in the scheduler only), the lab or the
commands.

- :mod:`.connector`: ``FaultInjectingConnector`` and the ``FaultInjecting<connector>``
  classes vLLM's factory looks up there; :mod:`.fault_mirror` builds those,
  :mod:`.fault_interface` forwards vLLM's connector interface,
  :mod:`.fault_plan` holds the settings, which loads fail and the KV poison,
  :mod:`.inner_connector` finds and configures the connector it wraps.

The names in ``__all__`` are imported on first use, so that importing this package never
imports vLLM or torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FaultConfigError", "FaultInjectingConnector", "fault_injecting"]


def __getattr__(name: str) -> Any:
    """The names of ``__all__``, from :mod:`.connector` (which imports vLLM and torch)."""
    if name in __all__:
        from kvmetrics.faults import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
