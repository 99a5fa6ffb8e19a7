"""What of vLLM's connector interface the fault wrapper forwards, and what it cannot.

vLLM grows its connector base (``KVConnectorBase_V1``) every few releases (0.34 added
``may_load_async``, ``kv_cache_access`` and ``supports_lookahead_block_hashes``,
among others) and reads a connector in three ways:

* **instance methods and properties**, called on the connector vLLM built:
  :func:`install` forwards every public one the installed vLLM's base has to the
  inner connector, found at import, so a method added by the next release is
  forwarded without a change here;
* **classmethods**, asked of the connector *class* found by name, also in processes
  that never build a connector: forwarded when their first parameter is a config
  the wrapper can translate into the inner connector's (:data:`TRANSLATABLE`); the
  wrapper finds the inner class from its own settings in that config;
* **interfaces declared by inheritance** (``SupportsHMA`` and any later
  ``Supports*`` mixin), which vLLM checks with ``issubclass`` on the class: only a
  class built for the inner connector can declare them
  (:mod:`kvmetrics.faults.fault_mirror`).

Whatever the inner class has that vLLM would not see through a given wrapper class
(an interface the wrapper does not declare; a member of the base the inner class
overrides and the wrapper neither implements nor forwards) :func:`unmirrored` lists,
and the wrapper refuses to start over it. A wrapper that vLLM takes for a different
connector changes vLLM's decisions: around NIXL, the plain wrapper turned the hybrid
KV cache manager off on the decode side only, NIXL hashes that flag into the
compatibility check its handshake compares, and every transfer failed.
"""

from __future__ import annotations

import abc
import inspect
import typing
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

#: First parameters of a classmethod that the wrapper can turn into the inner
#: connector's: its transfer config, the whole vLLM config, its extra config.
TRANSLATABLE = ("kv_transfer_config", "vllm_config", "extra_config")

#: Base members the wrapper keeps as the base has them: the same answer for both.
_KEEP = frozenset({"role"})

_NOT_INTERFACES = frozenset({object, abc.ABC, typing.Generic, typing.Protocol})

#: Marks a wrapper classmethod that can answer only in a process that built a connector
#: (vLLM's API server never does), so it does not mirror the inner class's answer.
PROCESS_LOCAL = "_kvmetrics_process_local"


def process_local(func: Callable[..., Any]) -> Callable[..., Any]:
    setattr(func, PROCESS_LOCAL, True)
    return func


def forwarder(name: str, member: Any) -> Any:
    """A method or property that asks the inner connector (``self._inner``)."""
    if isinstance(member, property):
        return property(lambda self: getattr(self._inner, name), doc=member.__doc__)

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)

    forward.__name__ = name
    forward.__doc__ = getattr(member, "__doc__", None)
    return forward


def config_parameter(member: classmethod[Any, ..., Any]) -> str | None:
    """The translatable config a classmethod takes first, or None."""
    try:
        params = list(inspect.signature(member.__func__).parameters)[1:]
    except (TypeError, ValueError):
        return None
    return params[0] if params and params[0] in TRANSLATABLE else None


def class_forwarder(name: str, param: str,
                    default: Callable[..., Any] | None = None) -> classmethod[Any, ..., Any]:
    """A classmethod that asks the inner connector's class, through the wrapper
    class's ``_ask_inner_class``; ``default`` answers where the inner class lacks
    ``name`` (a vLLM older than the method)."""

    def forward(cls: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        return cls._ask_inner_class(name, param, config, args, kwargs, default)

    forward.__name__ = name
    forward.__doc__ = f"The inner connector class's ``{name}``, for its own config."
    return classmethod(forward)


def install(wrapper: type) -> None:
    """Give ``wrapper`` a forwarder for every public member of vLLM's connector base it
    does not define itself (abstract ones included); what cannot be forwarded stays
    the base's, and :func:`unmirrored` reports it where the inner class overrides it."""
    for name, member in vars(KVConnectorBase_V1).items():
        if name.startswith("_") or name in _KEEP or name in vars(wrapper):
            continue
        if isinstance(member, classmethod):
            param = config_parameter(member)
            if param is not None:
                setattr(wrapper, name, class_forwarder(name, param))
        elif isinstance(member, property) or inspect.isfunction(member):
            setattr(wrapper, name, forwarder(name, member))
    abc.update_abstractmethods(wrapper)


def interfaces(connector_cls: type) -> tuple[type, ...]:
    """The interfaces a connector class declares by inheritance: every class of its MRO
    that is not a connector (vLLM's ``Supports*`` mixins, and whatever a later vLLM or
    a third-party connector adds), ``object``, ``ABC`` and typing's bases aside."""
    return tuple(c for c in connector_cls.__mro__
                 if not issubclass(c, KVConnectorBase_V1) and c not in _NOT_INTERFACES)


def _owner(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def overridden_data(inner: type) -> dict[str, Any]:
    """Class attributes of the base (not methods) that ``inner`` sets otherwise."""
    found = {}
    for name, member in vars(KVConnectorBase_V1).items():
        if name.startswith("__") or name.startswith("_abc") or callable(member) \
                or isinstance(member, property | classmethod | staticmethod):
            continue
        if _owner(inner, name) is not KVConnectorBase_V1:
            found[name] = getattr(inner, name)
    return found


def unmirrored(wrapper: type, inner: type) -> list[str]:
    """What of ``inner`` vLLM would not see through ``wrapper``: the interfaces it
    declares that ``wrapper`` does not, then the public members of the base it
    overrides that ``wrapper`` keeps as the base's or answers only in-process."""
    lost = [c.__name__ for c in interfaces(inner) if not issubclass(wrapper, c)]
    for name in vars(KVConnectorBase_V1):
        if name.startswith("_") or name in _KEEP or _owner(inner, name) is KVConnectorBase_V1:
            continue
        owner = _owner(wrapper, name)
        member = vars(owner)[name] if owner is not None else None
        func = getattr(member, "__func__", member)
        if owner is KVConnectorBase_V1 or getattr(func, PROCESS_LOCAL, False):
            lost.append(name)
    return lost
