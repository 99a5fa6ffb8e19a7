"""The ``FaultInjecting<connector>`` classes: FaultInjectingConnector mirroring one
connector class.

vLLM asks the connector *class* (found by name in each process, the API server
included, which never builds a connector) whether the hybrid KV cache manager may
stay on, which stats class rebuilds transfer stats, where hits come from. The plain
wrapper cannot answer for a connector named only in its extra config, so each
connector gets a subclass named after it that declares the same interfaces (vLLM's
``Supports*`` mixins, and any other non-connector class in the inner class's MRO,
:func:`~kvmetrics.faults.fault_interface.interfaces`), forwards their
methods to the inner connector and gives the inner class's class-level answers.

* A connector registered with vLLM: ``FaultInjecting<registered name>``, found by
  vLLM's factory as an attribute of :mod:`kvmetrics.faults.connector` (its
  module ``__getattr__`` calls :func:`resolve`), so the same class exists in every
  process.
* A connector from a module of one's own: ``FaultInjectingMyConnector =
  fault_injecting(MyConnector)`` in that module (``fault_injecting`` from
  :mod:`~kvmetrics.faults.connector`), named with ``kv_connector_module_path``
  as vLLM names any external connector.

Every function here takes the plain wrapper class (``base``) as an argument rather
than importing it: :mod:`~kvmetrics.faults.connector` imports this module,
never the other way round.

The plain wrapper refuses to start around a connector it would hide something of
(:func:`refuse_unmirrored`), with the name of the class to use.

Not mirrored: vLLM's checks of the connector's *name* (``has_connector("NixlConnector")``:
decode context parallelism, Mamba conv-state layout, routed experts), and
``MultiConnector``, whose HMA support vLLM works out from its children by name.
"""

from __future__ import annotations

import inspect
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvmetrics.faults.fault_interface import (
    forwarder,
    interfaces,
    overridden_data,
    unmirrored,
)
from kvmetrics.faults.fault_plan import FaultSettings, fail

#: Prefix of the mirrored classes' names: ``FaultInjecting`` + vLLM's registered name.
MIRROR_PREFIX = "FaultInjecting"
#: The plain wrapper class, FaultInjectingConnector (or a subclass).
Wrapper = type[KVConnectorBase_V1]
_mirrors: dict[tuple[Wrapper, str], Wrapper] = {}


def _interface_forwarders(mixins: tuple[type, ...]) -> dict[str, Any]:
    """The interfaces' public methods and properties, asking the inner connector: a
    mixin's own code would run on the wrapper's state, not the inner connector's."""
    methods: dict[str, Any] = {}
    for mixin in mixins:
        for name, member in vars(mixin).items():
            if name.startswith("_") or name == "request_finished_all_groups":
                continue  # the wrapper's own, below
            if isinstance(member, property) or inspect.isfunction(member):
                methods.setdefault(name, forwarder(name, member))
    return methods


def _request_finished_all_groups(self: Any, request: Any,
                                 block_ids: tuple[list[int], ...]) -> Any:
    # vLLM calls this instead of request_finished on an HMA connector.
    self._lookups.pop(request.request_id, None)
    self._emulated.discard(request.request_id)
    return self._inner.request_finished_all_groups(request, block_ids)


def _build(base: Wrapper, inner: type[KVConnectorBase_V1], name: str, wrapped_name: str,
           wrapped_module: str | None, module: str) -> Wrapper:
    mixins = interfaces(inner)
    namespace: dict[str, Any] = {
        "__module__": module, "__qualname__": name,
        "__doc__": f"{base.__name__} around {inner.__name__}, with its interfaces.",
        "_wrapped_name": wrapped_name, "_wrapped_module": wrapped_module,
        # The API server never builds a connector: answer from the class itself.
        "build_kv_connector_stats": classmethod(
            lambda cls, data=None: inner.build_kv_connector_stats(data)),
        **_interface_forwarders(mixins),
        **overridden_data(inner),  # e.g. _cache_hit_source
    }
    if any(hasattr(m, "request_finished_all_groups") for m in mixins):
        namespace["request_finished_all_groups"] = _request_finished_all_groups
    return type(name, (base, *mixins), namespace)


def mirrored_connector(base: Wrapper, inner_name: str) -> Wrapper:
    """``base`` (the plain wrapper) for vLLM's registered connector ``inner_name``: a
    subclass declaring the inner class's interfaces and answering vLLM's class-level
    questions (stats class, hit source) with the inner class's answers. Built once
    per process on first lookup; reachable as ``FaultInjecting<inner_name>`` in
    ``base``'s module, so vLLM's factory finds it by name in every process."""
    cached = _mirrors.get((base, inner_name))
    if cached is not None:
        return cached
    inner = KVConnectorFactory.get_connector_class_by_name(inner_name)
    if not (isinstance(inner, type) and issubclass(inner, KVConnectorBase_V1)):
        raise ValueError(f"{inner_name!r} is not a v1 KV connector")
    if inner_name == "MultiConnector":
        # Its HMA support depends on its children, which vLLM asks by name.
        raise ValueError("MultiConnector cannot be mirrored; wrap its children instead")
    cls = _build(base, inner, MIRROR_PREFIX + inner_name, inner_name, None, base.__module__)
    _mirrors[(base, inner_name)] = cls
    return cls


def mirror_of(base: Wrapper, inner: type[KVConnectorBase_V1]) -> Wrapper:
    """``base`` mirroring a connector class that is not registered with vLLM, living in
    the inner class's module (what ``faults.fault_injecting`` returns)."""
    if not (isinstance(inner, type) and issubclass(inner, KVConnectorBase_V1)):
        raise TypeError(f"{inner!r} is not a v1 KV connector class")
    name = MIRROR_PREFIX + inner.__name__
    return _build(base, inner, name, inner.__name__, inner.__module__, inner.__module__)


def resolve(base: Wrapper, name: str) -> Any:
    """``FaultInjecting<registered connector>``: the mirrored class, built on demand
    (the ``__getattr__`` of ``base``'s module)."""
    if name.startswith(MIRROR_PREFIX) and name != base.__name__ \
            and len(name) > len(MIRROR_PREFIX):
        try:
            return mirrored_connector(base, name[len(MIRROR_PREFIX):])
        except (ValueError, ImportError) as e:
            raise AttributeError(f"{name}: {str(e).splitlines()[0] if str(e) else e!r}") \
                from None
    raise AttributeError(f"module {base.__module__!r} has no attribute {name!r}")


def _registered_as(inner: type, name: str) -> bool:
    """Whether vLLM's factory registers ``inner`` under ``name`` (loaded by module path)."""
    try:
        return KVConnectorFactory.get_connector_class_by_name(name) is inner
    except Exception:
        return False


def refuse_unmirrored(wrapper: Any, inner: type,
                      settings: FaultSettings) -> None:
    """Raise FaultConfigError (one line) when vLLM would not see all of ``inner`` through
    ``wrapper``, naming the class that mirrors it. vLLM would treat the wrapper as a
    different connector and decide differently; with NIXL every transfer then failed
    on a compatibility hash mismatch, a rehearsal turned into an outage."""
    lost = unmirrored(wrapper, inner)
    if not lost:
        return
    what = (f"{inner.__name__} has {', '.join(lost)}, which vLLM would not see through "
            f"{wrapper.__name__} (it would decide as for another connector, e.g. turn the "
            "hybrid KV cache manager off, which NIXL hashes into its compatibility check)")
    if wrapper._wrapped_name is not None:
        raise fail("inner_connector", f"{what}; kvmetrics cannot mirror these yet")
    if settings.inner_module_path is None or _registered_as(inner, settings.inner_connector):
        try:
            mirror = mirrored_connector(wrapper, settings.inner_connector)
        except (ValueError, ImportError) as e:
            raise fail("inner_connector", f"{what}; and it cannot be mirrored: "
                       f"{str(e).splitlines()[0] if str(e) else e!r}") from None
        if unmirrored(mirror, inner):
            raise fail("inner_connector", f"{what}; kvmetrics cannot mirror "
                       f"{', '.join(unmirrored(mirror, inner))} yet")
        raise fail("inner_connector", f'{what}; use "kv_connector": "{mirror.__name__}" '
                   f'with "kv_connector_module_path": "{wrapper.__module__}"')
    raise fail("inner_connector", f"{what}; add {MIRROR_PREFIX}{inner.__name__} = "
               f"fault_injecting({inner.__name__}) (from {wrapper.__module__}) to "
               f"{settings.inner_module_path} and name that class instead")
