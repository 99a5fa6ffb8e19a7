"""The ``FaultInjecting<connector>`` classes: FaultInjectingConnector mirroring one
connector registered with vLLM.

vLLM asks the connector *class* (found by name in each process, the API server
included, which never builds a connector) whether the hybrid KV cache manager may
stay on, which stats class rebuilds transfer stats, where hits come from. The plain
wrapper cannot answer for a connector named only in its extra config, so each
registered connector gets a subclass named after it that declares the same
optional interfaces (vLLM's ``Supports*`` mixins) and gives the inner class's
answers. vLLM's factory finds it as an attribute of
:mod:`kvmetrics.integrations.vllm.faults` (its module ``__getattr__`` calls
:func:`resolve`), so the same class exists in every process.

Not mirrored: vLLM's checks of the connector's *name* (``has_connector("NixlConnector")``:
decode context parallelism, Mamba conv-state layout, routed experts), and
``MultiConnector``, whose HMA support vLLM works out from its children by name.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvmetrics.integrations.vllm import faults
from kvmetrics.integrations.vllm.fault_plan import FaultSettings
from kvmetrics.integrations.vllm.faults import FaultInjectingConnector, log

#: Prefix of the mirrored classes' names: ``FaultInjecting`` + vLLM's registered name.
MIRROR_PREFIX = "FaultInjecting"
_mirrors: dict[str, type[FaultInjectingConnector]] = {}


def capabilities(connector_cls: type) -> tuple[type, ...]:
    """The optional interfaces (vLLM's ``Supports*`` mixins) a connector class declares:
    every class in its MRO from vLLM's connector package that is not a connector."""
    return tuple(c for c in connector_cls.__mro__
                 if c.__module__.startswith("vllm.distributed.kv_transfer")
                 and not issubclass(c, KVConnectorBase_V1))


def _mixin_forwarders(mixins: tuple[type, ...]) -> dict[str, Any]:
    """Concrete methods for the mixins' abstract ones, asking the inner connector."""
    methods: dict[str, Any] = {}
    for mixin in mixins:
        for name in getattr(mixin, "__abstractmethods__", ()):
            if name == "request_finished_all_groups":
                continue  # the wrapper's own, below
            methods[name] = faults._forwarder(name, getattr(mixin, name))
    return methods


def _request_finished_all_groups(self: FaultInjectingConnector, request: Any,
                                 block_ids: tuple[list[int], ...]) -> Any:
    # vLLM calls this instead of request_finished on an HMA connector.
    self._lookups.pop(request.request_id, None)
    self._emulated.discard(request.request_id)
    return self._inner.request_finished_all_groups(request, block_ids)


def mirrored_connector(inner_name: str) -> type[FaultInjectingConnector]:
    """``FaultInjectingConnector`` for vLLM's registered connector ``inner_name``: a
    subclass declaring the inner class's optional interfaces and answering vLLM's
    class-level questions (stats class, hit source) with the inner class's answers.
    Built once per process on first lookup; reachable as ``FaultInjecting<inner_name>``
    in this module, so vLLM's factory finds it by name in every process."""
    cached = _mirrors.get(inner_name)
    if cached is not None:
        return cached
    inner = KVConnectorFactory.get_connector_class_by_name(inner_name)
    if not (isinstance(inner, type) and issubclass(inner, KVConnectorBase_V1)):
        raise ValueError(f"{inner_name!r} is not a v1 KV connector")
    if inner_name == "MultiConnector":
        # Its HMA support depends on its children, which vLLM asks by name.
        raise ValueError("MultiConnector cannot be mirrored; wrap its children instead")
    mixins = capabilities(inner)
    name = MIRROR_PREFIX + inner_name
    namespace: dict[str, Any] = {
        "__module__": faults.__name__, "__qualname__": name,
        "__doc__": f"FaultInjectingConnector around {inner_name}, with its interfaces.",
        "_wrapped_name": inner_name,
        "build_kv_connector_stats": classmethod(
            lambda cls, data=None: inner.build_kv_connector_stats(data)),
        **_mixin_forwarders(mixins),
    }
    if "_cache_hit_source" in dir(inner):
        namespace["_cache_hit_source"] = inner._cache_hit_source
    if any(hasattr(m, "request_finished_all_groups") for m in mixins):
        namespace["request_finished_all_groups"] = _request_finished_all_groups
    cls = type(name, (FaultInjectingConnector, *mixins), namespace)
    _mirrors[inner_name] = cls
    return cls


def resolve(name: str) -> Any:
    """``FaultInjecting<registered connector>``: the mirrored class, built on demand
    (the module ``faults``' ``__getattr__``)."""
    if name.startswith(MIRROR_PREFIX) and name != "FaultInjectingConnector" \
            and len(name) > len(MIRROR_PREFIX):
        try:
            return mirrored_connector(name[len(MIRROR_PREFIX):])
        except (ValueError, ImportError) as e:
            raise AttributeError(f"{name}: {str(e).splitlines()[0] if str(e) else e!r}") \
                from None
    raise AttributeError(f"module {faults.__name__!r} has no attribute {name!r}")


_warned_unmirrored: set[str] = set()


def warn_if_not_mirrored(wrapper: type, inner: type, settings: FaultSettings) -> None:
    """Say once when vLLM sees fewer interfaces than the inner connector declares."""
    missing = [c.__name__ for c in capabilities(inner) if not issubclass(wrapper, c)]
    plain_stats = inner.build_kv_connector_stats.__func__ is \
        KVConnectorBase_V1.build_kv_connector_stats.__func__
    if wrapper._wrapped_name is not None or (not missing and plain_stats):
        return
    if inner.__name__ in _warned_unmirrored:
        return
    _warned_unmirrored.add(inner.__name__)
    lost = " and ".join(missing + ([] if plain_stats else
                                   ["a stats class (the API server's transfer-metrics log)"]))
    fix = (f'use "kv_connector": "{MIRROR_PREFIX}{settings.inner_connector}" to keep them'
           if settings.inner_module_path is None else "this wrapper cannot mirror a "
           "connector loaded from a module path")
    log.warning("FaultInjectingConnector: %s declares %s, which vLLM does not see through "
                "this wrapper (it behaves as a connector without them); %s",
                inner.__name__, lost, fix)
