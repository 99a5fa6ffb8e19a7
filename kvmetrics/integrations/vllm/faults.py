"""A vLLM KV connector that wraps another one and makes some of its loads fail.

For rehearsing recovery and alerts in staging with the connector you really run
(LMCache, Mooncake, NIXL, ...), and for the end-to-end tests with vLLM's
``ExampleConnector``::

    --kv-transfer-config '{"kv_connector": "FaultInjectingConnector",
      "kv_connector_module_path": "kvmetrics.integrations.vllm.faults",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {
        "inner_connector": "ExampleConnector",
        "inner_extra_config": {"shared_storage_path": "/tmp/kv"},
        "fault_rate": 0.1, "fault_seed": 7}}'

The inner connector is built through vLLM's own connector factory with its own
``kv_connector_extra_config`` and does all the real work; every method of vLLM's
connector interface is forwarded to it. The wrapper only adds:

* **Which loads fail** is decided on the scheduler side, where loads are seen in
  one order: every admission the inner connector grants external tokens is a
  *load*, numbered from 1. A load fails if its number is in ``fault_loads`` or a
  draw seeded by ``(fault_seed, number)`` is below ``fault_rate``; one block of
  it fails, ``fault_block`` (an index into the load's external blocks, negative
  from the end) or one drawn from the same seed. The decision rides to the
  workers in the connector metadata, so every tensor-parallel worker fails the
  same blocks.
* **The failure happens on the worker side**, after the inner connector wrote the
  load: the failed blocks are overwritten with large seeded noise in every layer's
  KV cache (so a request that reads them is visibly thrown off, instead of
  finding a plausible leftover; finite, see :func:`poison_blocks`) and reported
  through ``get_block_ids_with_load_errors``. Sync loads fail in the
  pass that loads them; the inner connector's async loads fail in the pass where
  it reports the request as finished receiving, as vLLM's interface asks.
* **Async failures for an inner connector that loads only synchronously**
  (``ExampleConnector``): with ``fault_mode="async"`` a load chosen to fail is
  offered to vLLM as an *async* load and never handed to the inner connector;
  the wrapper itself finishes it ``async_steps`` worker passes later, with every
  block of the load failed and poisoned (a partly valid load is impossible, as
  nothing was loaded). vLLM's async recovery path then runs exactly as for a real
  async connector; the retried request loads through the inner connector.
  Loads not chosen stay synchronous and untouched. ``fault_mode="mixed"`` draws,
  per failing load and from the same seed, which of the two ways it fails.

Every setting is checked when vLLM builds the connector (scheduler and workers);
a bad one raises :class:`FaultConfigError`, a one-line message naming the key,
and the server stops at start-up.

**Invisible but for its faults.** vLLM decides things from the connector *class*,
before any connector exists and in processes that never build one: whether the
hybrid KV cache manager stays on (``SupportsHMA``; NIXL puts that flag in the
compatibility hash its peers compare), which stats class rebuilds the workers'
transfer stats in the API server (the periodic "KV Transfer metrics" lines), which
Prometheus series the connector adds, where cache hits come from. A class cannot
read ``inner_connector`` out of a config it is never shown, so the wrapper for a
connector registered with vLLM is named after it: ``FaultInjectingNixlConnector``,
``FaultInjectingLMCacheMPConnector``, ... (``FaultInjecting`` + the registered
name; ``inner_connector`` may then be left out). Such a class is built on first
lookup, the same in every process, by :func:`mirrored_connector`: it declares every
optional interface the inner class declares and answers vLLM's class-level
questions with the inner class's answers. The plain ``FaultInjectingConnector``
(needed for a connector loaded from ``inner_module_path``) declares none, so vLLM
treats it as a connector without them; it logs a warning naming the mirrored class
when the inner connector has some. The mirrored classes are built in
:mod:`kvmetrics.integrations.vllm.fault_mirror`.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvmetrics.integrations.vllm.fault_plan import (
    FAULT_MODES,
    POISON_SCALE,
    FaultConfigError,
    FaultPlan,
    FaultSettings,
    InjectedFault,
    fail,
    parse_settings,
    poison_blocks,
)

__all__ = ["FAULT_MODES", "POISON_SCALE", "FaultConfigError", "FaultInjectingConnector",
           "FaultInjectingMetadata", "FaultPlan", "FaultSettings", "InjectedFault",
           "parse_settings", "poison_blocks"]

# Under vLLM's logger tree so the lines carry vLLM's prefix (process, time).
log = logging.getLogger("vllm.kvmetrics.faults")

@dataclass
class FaultInjectingMetadata(KVConnectorMetadata):
    """The inner connector's metadata for the step plus the faults to inject."""

    inner: Any = None
    faults: list[InjectedFault] = field(default_factory=list)


def _inner_transfer_config(kv_transfer_config: Any, settings: FaultSettings) -> Any:
    return dataclasses.replace(
        kv_transfer_config, kv_connector=settings.inner_connector,
        kv_connector_module_path=settings.inner_module_path,
        kv_connector_extra_config=copy.deepcopy(settings.inner_extra_config))


def _inner_vllm_config(vllm_config: Any, settings: FaultSettings) -> Any:
    """A shallow copy of vLLM's config whose transfer config names the inner connector."""
    inner = copy.copy(vllm_config)
    object.__setattr__(inner, "kv_transfer_config",
                       _inner_transfer_config(vllm_config.kv_transfer_config, settings))
    return inner


def _inner_class(kv_transfer_config: Any, settings: FaultSettings) -> type[KVConnectorBase_V1]:
    try:
        cls = KVConnectorFactory.get_connector_class(
            _inner_transfer_config(kv_transfer_config, settings))
    except Exception as e:
        key = "inner_module_path" if settings.inner_module_path else "inner_connector"
        raise fail(key, f"cannot load connector {settings.inner_connector!r}: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise fail("inner_connector", f"{settings.inner_connector!r} is not a v1 KV connector")
    return cls


def _extra(kv_transfer_config: Any) -> Any:
    return getattr(kv_transfer_config, "kv_connector_extra_config", None)


#: Methods the wrapper implements itself; every other public method of vLLM's
#: connector interface is forwarded to the inner connector unchanged.
_OWN = frozenset({
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "request_finished", "bind_connector_metadata", "clear_connector_metadata",
    "has_connector_metadata", "register_kv_caches", "start_load_kv", "wait_for_layer_load",
    "get_finished", "get_transfer_results", "get_block_ids_with_load_errors",
    "handle_preemptions", "role",
    # classmethods, resolved against the inner class below
    "get_required_kvcache_layout", "requires_piecewise_for_cudagraph", "supports_sleep_mode",
    "build_kv_connector_stats", "build_prom_metrics",
})


class FaultInjectingConnector(KVConnectorBase_V1):
    """Any KV connector, with a deterministic share of its loads failing on the workers."""

    #: The inner connector class last resolved in this process (for the classmethods
    #: that get no config, e.g. ``build_kv_connector_stats``).
    _last_inner_class: type[KVConnectorBase_V1] | None = None
    #: The registered connector a mirrored class wraps (None: read ``inner_connector``).
    _wrapped_name: str | None = None

    @classmethod
    def parse(cls, extra: Any) -> FaultSettings:
        """This class's settings from ``kv_connector_extra_config``."""
        fixed = cls._wrapped_name
        if fixed is not None:
            extra = dict(extra or {})
            given = extra.setdefault("inner_connector", fixed)
            if given != fixed:
                raise fail("inner_connector", f"{cls.__name__} wraps {fixed}, got {given!r}")
            if extra.get("inner_module_path") is not None:
                raise fail("inner_module_path", f"{cls.__name__} wraps vLLM's registered "
                           f"{fixed}; use FaultInjectingConnector for a connector module")
        return parse_settings(extra)

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = self.parse(_extra(self._kv_transfer_config))
        self.plan = FaultPlan(self.settings)
        cls = _inner_class(self._kv_transfer_config, self.settings)
        FaultInjectingConnector._last_inner_class = cls
        from kvmetrics.integrations.vllm.fault_mirror import warn_if_not_mirrored

        warn_if_not_mirrored(type(self), cls, self.settings)
        self._inner = cls(_inner_vllm_config(vllm_config, self.settings), role,
                          kv_cache_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        # scheduler side
        self._loads = 0
        self._lookups: dict[str, tuple[int, bool]] = {}  # rid -> (local tokens, inner async)
        self._emulated: set[str] = set()  # rids offered as async loads by the wrapper
        self._new_faults: list[InjectedFault] = []
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._step_faults: list[InjectedFault] = []
        self._awaiting_inner: dict[str, InjectedFault] = {}
        self._emulating: dict[str, list[Any]] = {}  # rid -> [fault, passes left]
        self._errors: set[int] = set()
        self._warned_layout = False
        log.info("FaultInjectingConnector around %s (%s): fault_rate=%g seed=%d loads=%s "
                 "block=%s mode=%s", cls.__name__, role.name, self.settings.fault_rate,
                 self.settings.fault_seed, sorted(self.settings.fault_loads),
                 self.settings.fault_block, self.settings.fault_mode)

    @property
    def inner(self) -> KVConnectorBase_V1:
        return self._inner

    def __getattr__(self, name: str) -> Any:
        # Connector-specific attributes beyond vLLM's interface.
        inner = self.__dict__.get("_inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    # -- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens, load_async = self._inner.get_num_new_matched_tokens(request, num_computed_tokens)
        rid = request.request_id
        self._lookups[rid] = (num_computed_tokens, bool(load_async))
        self._emulated.discard(rid)
        number = self._loads + 1
        if (tokens and not load_async and self.settings.fault_mode != "inner"
                and self.plan.fails(number) and self.plan.emulates_async(number)):
            # The next load fails: offer it as async, to be finished by the wrapper.
            self._emulated.add(rid)
            return tokens, True
        return tokens, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> Any:
        rid = request.request_id
        emulated = rid in self._emulated and num_external_tokens > 0
        self._emulated.discard(rid)
        result = self._inner.update_state_after_alloc(
            request, blocks, 0 if emulated else num_external_tokens)
        if num_external_tokens <= 0:
            return result
        self._loads += 1
        number = self._loads
        local, inner_async = self._lookups.pop(rid, (0, False))
        try:
            all_ids = list(blocks.get_block_ids()[0])
        except Exception:
            all_ids = []
        bs = self._block_size
        ids = all_ids[local // bs: -(-(local + num_external_tokens) // bs)]
        if emulated:
            self._new_faults.append(InjectedFault(number, rid, tuple(ids), "emulated"))
            return result
        index = self.plan.failing_block(number, len(ids))
        if index is not None:
            mode = "async" if inner_async else "sync"
            self._new_faults.append(InjectedFault(number, rid, (ids[index],), mode))
        return result

    def build_connector_meta(self, scheduler_output: Any) -> FaultInjectingMetadata:
        faults, self._new_faults = self._new_faults, []
        return FaultInjectingMetadata(self._inner.build_connector_meta(scheduler_output), faults)

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._lookups.pop(request.request_id, None)
        self._emulated.discard(request.request_id)
        return self._inner.request_finished(request, block_ids)

    # -- worker side ----------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, FaultInjectingMetadata):
            self._step_faults = [f for f in connector_metadata.faults if f.mode == "sync"]
            for fault in connector_metadata.faults:
                if fault.mode == "async":
                    self._awaiting_inner[fault.request_id] = fault
                elif fault.mode == "emulated":
                    self._emulating[fault.request_id] = [fault, self.settings.async_steps]
            self._inner.bind_connector_metadata(connector_metadata.inner)
        else:
            self._step_faults = []
            self._inner.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._step_faults = []
        self._inner.clear_connector_metadata()

    def has_connector_metadata(self) -> bool:
        return self._inner.has_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: Any) -> Any:
        if isinstance(kv_connector_metadata, FaultInjectingMetadata):
            kv_connector_metadata = kv_connector_metadata.inner
        return self._inner.handle_preemptions(kv_connector_metadata)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> Any:
        self._kv_caches = dict(kv_caches)
        return self._inner.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._inner.start_load_kv(forward_context, **kwargs)
        if self._step_faults:
            self._poison(self._step_faults, forward_context=forward_context)
            for fault in self._step_faults:
                self._errors.update(fault.block_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._inner.wait_for_layer_load(layer_name)
        if self._step_faults and layer_name in self._kv_caches:
            # A layer-wise inner connector writes layer by layer: poison after it.
            ids = [b for f in self._step_faults for b in f.block_ids]
            poison_blocks({layer_name: self._kv_caches[layer_name]}, ids, self._num_blocks)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        sending, recving = self._inner.get_finished(finished_req_ids)
        return sending, self._finish_async(set(recving or ())) or recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = self._inner.get_transfer_results(finished_req_ids)
        results.finished_recving = self._finish_async(set(results.finished_recving))
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return set(self._inner.get_block_ids_with_load_errors()) | errors

    def _finish_async(self, recving: set[str]) -> set[str]:
        """One worker pass: fail finished inner async loads, finish due emulated ones."""
        done = [self._awaiting_inner.pop(rid) for rid in list(self._awaiting_inner)
                if rid in recving]
        for rid, entry in list(self._emulating.items()):
            entry[1] -= 1
            if entry[1] <= 0:
                del self._emulating[rid]
                done.append(entry[0])
                recving.add(rid)
        if done:
            self._poison(done)
            for fault in done:
                self._errors.update(fault.block_ids)
        return recving

    def _poison(self, faults: list[InjectedFault], forward_context: Any = None) -> None:
        caches = self._kv_caches or self._layer_caches(forward_context)
        ids = [b for f in faults for b in f.block_ids]
        skipped = poison_blocks(caches, ids, self._num_blocks)
        for fault in faults:
            log.warning("FaultInjectingConnector: failing load #%d of request %s (%s): "
                        "blocks %s", fault.number, fault.request_id, fault.mode,
                        list(fault.block_ids))
        if (skipped or not caches) and not self._warned_layout:
            self._warned_layout = True
            log.warning("FaultInjectingConnector: could not poison %s; the failed blocks are "
                        "reported but keep their contents",
                        ", ".join(skipped) if skipped else "any layer (no KV caches known)")

    @staticmethod
    def _layer_caches(forward_context: Any) -> dict[str, torch.Tensor]:
        layers = getattr(forward_context, "no_compile_layers", None) or {}
        caches = {}
        for name, layer in layers.items():
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, list | tuple):
                kv = kv[0] if kv else None
            if isinstance(kv, torch.Tensor):
                caches[name] = kv
        return caches

    # -- classmethods: answered by the inner connector's class ------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        settings = cls.parse(_extra(vllm_config.kv_transfer_config))
        inner = _inner_class(vllm_config.kv_transfer_config, settings)
        return inner.get_required_kvcache_layout(_inner_vllm_config(vllm_config, settings))

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        settings = cls.parse(extra_config)
        inner = KVConnectorFactory.get_connector_class(_InnerOnly(settings))
        return bool(inner.requires_piecewise_for_cudagraph(dict(settings.inner_extra_config)))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        settings = cls.parse(_extra(kv_transfer_config))
        inner = _inner_class(kv_transfer_config, settings)
        check = getattr(inner, "supports_sleep_mode", None)
        return True if check is None else bool(
            check(_inner_transfer_config(kv_transfer_config, settings)))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        inner = cls._last_inner_class
        return None if inner is None else inner.build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        settings = cls.parse(_extra(vllm_config.kv_transfer_config))
        inner = _inner_class(vllm_config.kv_transfer_config, settings)
        return inner.build_prom_metrics(_inner_vllm_config(vllm_config, settings),
                                        *args, **kwargs)


@dataclass
class _InnerOnly:
    """Just enough of a transfer config for the factory to find the inner class."""

    settings: FaultSettings

    @property
    def kv_connector(self) -> str:
        return self.settings.inner_connector

    @property
    def kv_connector_module_path(self) -> str | None:
        return self.settings.inner_module_path


def _forwarder(name: str, member: Any) -> Any:
    """A method or property of the interface that simply asks the inner connector."""
    if isinstance(member, property):
        return property(lambda self: getattr(self._inner, name), doc=member.__doc__)

    def forward(self: FaultInjectingConnector, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)

    forward.__name__ = name
    forward.__doc__ = getattr(member, "__doc__", None)
    return forward


def _install_forwarders() -> None:
    for name, member in vars(KVConnectorBase_V1).items():
        if name.startswith("_") or name in _OWN:
            continue
        if isinstance(member, classmethod | staticmethod):
            continue
        if isinstance(member, property) or inspect.isfunction(member):
            setattr(FaultInjectingConnector, name, _forwarder(name, member))
    abc.update_abstractmethods(FaultInjectingConnector)


_install_forwarders()


def __getattr__(name: str) -> Any:
    """``FaultInjecting<registered connector>``: the mirrored class, built on first lookup
    (see :mod:`kvmetrics.integrations.vllm.fault_mirror`)."""
    from kvmetrics.integrations.vllm import fault_mirror

    return fault_mirror.resolve(name)
