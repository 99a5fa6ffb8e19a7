"""Configurations written before the package move keep working.

Fleets name ``--scheduler-cls kvmetrics.integrations.vllm.scheduler.InstrumentedScheduler``
and ``"kv_connector_module_path": "kvmetrics.integrations.vllm.faults"``. Both old paths
are aliases that resolve, through vLLM's own lookups, to the very same class objects as
the new paths (identity, not copies: one class for isinstance checks, for the mirrored
connectors' cache and for the protective recovery's composition).
"""

from __future__ import annotations

import importlib

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from kvmetrics.faults import connector
from kvmetrics.lab.engine.scheduler import SchedulerConfig
from kvmetrics.lab.vllm import builder
from kvmetrics.vllm import scheduler

pytestmark = pytest.mark.vllm

#: old module -> the module that now holds its classes
ALIASES = {"kvmetrics.integrations.vllm.scheduler": "kvmetrics.vllm.scheduler",
           "kvmetrics.integrations.vllm.faults": "kvmetrics.faults.connector"}


@pytest.mark.parametrize("name", ["InstrumentedScheduler", "InstrumentedAsyncScheduler"])
def test_the_old_scheduler_cls_resolves_to_the_same_class(name: str) -> None:
    config = SchedulerConfig(block_size=16, num_gpu_blocks=64, max_num_seqs=8,
                             max_num_batched_tokens=256, max_model_len=512)
    vllm_config = builder.build_vllm_config(
        config, scheduler_cls=f"kvmetrics.integrations.vllm.scheduler.{name}")
    assert vllm_config.scheduler_config.get_scheduler_cls() is getattr(scheduler, name)


@pytest.mark.parametrize("name", ["FaultInjectingConnector", "FaultInjectingExampleConnector"])
def test_the_old_connector_module_path_resolves_to_the_same_class(name: str) -> None:
    """The plain wrapper, and a mirrored one (built on first lookup by either path)."""
    def found(module: str) -> type:
        return KVConnectorFactory.get_connector_class(KVTransferConfig(
            kv_connector=name, kv_connector_module_path=module, kv_role="kv_both"))

    old = found("kvmetrics.integrations.vllm.faults")
    assert old is found("kvmetrics.faults.connector") is getattr(connector, name)


def test_each_alias_re_exports_the_same_objects_and_says_where_they_moved() -> None:
    for old_name, new_name in ALIASES.items():
        old, new = importlib.import_module(old_name), importlib.import_module(new_name)
        assert old.__all__ and all(getattr(old, n) is getattr(new, n) for n in old.__all__)
        doc = " ".join((old.__doc__ or "").split())
        assert doc.startswith("Deprecated alias, kept for existing configurations"), old_name
        assert new_name in doc, old_name
