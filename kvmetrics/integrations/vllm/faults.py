"""Deprecated alias, kept for existing configurations: use
``"kv_connector_module_path": "kvmetrics.faults.connector"``.

``"kv_connector_module_path": "kvmetrics.integrations.vllm.faults"`` keeps working, with
``FaultInjectingConnector`` and every ``FaultInjecting<registered connector>`` class:
the very same classes as :mod:`kvmetrics.faults.connector`'s (the mirrored ones are built
there once, on first lookup through either path), not copies.
"""

from __future__ import annotations

from typing import Any

from kvmetrics.faults import connector
from kvmetrics.faults.connector import FaultConfigError, FaultInjectingConnector, fault_injecting

__all__ = ["FaultConfigError", "FaultInjectingConnector", "fault_injecting"]


def __getattr__(name: str) -> Any:
    """``FaultInjecting<registered connector>``, as :mod:`kvmetrics.faults.connector`
    resolves it (vLLM's factory looks the class up in the module it is named with)."""
    return getattr(connector, name)
