"""A vLLM KV connector that wraps another one and makes some of its loads fail.

For rehearsing recovery and alerts in staging with the connector you really run
(LMCache, Mooncake, NIXL, ...), and for the end-to-end tests with vLLM's
``ExampleConnector``::

    --kv-transfer-config '{"kv_connector": "FaultInjectingConnector",
      "kv_connector_module_path": "kvmetrics.faults.connector",
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

**Invisible but for its faults.** vLLM asks the connector *class* (in processes that
never build a connector) about interfaces, stats and hits; the plain class cannot know
the inner connector there, so a connector is wrapped by a class named after it,
``FaultInjecting<registered name>`` (built on first lookup by
:mod:`~kvmetrics.faults.fault_mirror`) or ``fault_injecting(MyConnector)`` for one of
one's own module. The plain ``FaultInjectingConnector`` refuses to start, with a
one-line :class:`FaultConfigError` naming the class to use, whenever the inner class
has anything it cannot show vLLM. What is forwarded and checked is
:mod:`kvmetrics.faults.fault_interface`; how the inner connector is found and
configured, :mod:`kvmetrics.faults.inner_connector`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvmetrics.faults import fault_mirror
from kvmetrics.faults.fault_interface import class_forwarder, install, process_local
from kvmetrics.faults.fault_plan import (
    FaultConfigError,
    FaultPlan,
    FaultSettings,
    InjectedFault,
    fail,
    parse_settings,
    poison_blocks,
)
from kvmetrics.faults.inner_connector import (
    InnerOnly,
    extra_config,
    inner_class,
    inner_transfer_config,
    inner_vllm_config,
)
from kvmetrics.metrics.logs import get_logger

__all__ = ["FaultConfigError", "FaultInjectingConnector", "FaultInjectingMetadata",
           "fault_injecting"]

# Under vLLM's logger tree so the lines carry vLLM's prefix (process, time).
log = get_logger("vllm.kvmetrics.faults")

@dataclass
class FaultInjectingMetadata(KVConnectorMetadata):
    """The inner connector's metadata for the step plus the faults to inject."""

    inner: Any = None
    faults: list[InjectedFault] = field(default_factory=list)


class FaultInjectingConnector(KVConnectorBase_V1):
    """Any KV connector, with a deterministic share of its loads failing on the workers."""

    #: The inner connector class last resolved in this process (for the classmethods
    #: that get no config, e.g. ``build_kv_connector_stats``).
    _last_inner_class: type[KVConnectorBase_V1] | None = None
    #: The connector a mirrored class wraps: its name (None: read ``inner_connector``)
    #: and, for one not registered with vLLM, its module (``inner_module_path``).
    _wrapped_name: str | None = None
    _wrapped_module: str | None = None

    if TYPE_CHECKING:
        # Forwarded to the inner connector by ``install`` below, as every base member
        # the class does not define; spelled out for the type checker only.
        def save_kv_layer(self, *args: Any, **kwargs: Any) -> None: ...

        def wait_for_save(self) -> None: ...

    @classmethod
    def parse(cls, extra: Any) -> FaultSettings:
        """This class's settings from ``kv_connector_extra_config``."""
        fixed = cls._wrapped_name
        if fixed is not None:
            extra = dict(extra or {})
            given = extra.setdefault("inner_connector", fixed)
            if given != fixed:
                raise fail("inner_connector", f"{cls.__name__} wraps {fixed}, got {given!r}")
            module = extra.setdefault("inner_module_path", cls._wrapped_module)
            if module != cls._wrapped_module:
                where = (f"{fixed} of {cls._wrapped_module}" if cls._wrapped_module
                         else f"vLLM's registered {fixed}")
                raise fail("inner_module_path", f"{cls.__name__} wraps {where}, got {module!r}")
        return parse_settings(extra)

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = self.parse(extra_config(self._kv_transfer_config))
        self.plan = FaultPlan(self.settings)
        cls = inner_class(self._kv_transfer_config, self.settings)
        FaultInjectingConnector._last_inner_class = cls
        fault_mirror.refuse_unmirrored(type(self), cls, self.settings)
        self._inner = cls(inner_vllm_config(vllm_config, self.settings), role,
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

    # -- class-level questions: answered by the inner connector's class --------------

    @classmethod
    def _ask_inner_class(cls, name: str, param: str, config: Any, args: tuple[Any, ...],
                         kwargs: dict[str, Any], default: Any = None) -> Any:
        """The inner class's ``name``, asked with ``config`` (the wrapper's, of the kind
        ``param`` names) translated into the inner connector's; ``default`` (or None)
        where the inner class lacks it."""
        if param == "extra_config":
            settings = cls.parse(config)
            inner = inner_class(InnerOnly(settings), settings)
            inner_config: Any = dict(settings.inner_extra_config)
        else:
            transfer = config if param == "kv_transfer_config" else config.kv_transfer_config
            settings = cls.parse(extra_config(transfer))
            inner = inner_class(transfer, settings)
            inner_config = (inner_transfer_config(transfer, settings)
                            if param == "kv_transfer_config"
                            else inner_vllm_config(config, settings))
        method = getattr(inner, name, None)
        if method is None:
            return None if default is None else default(inner_config, *args, **kwargs)
        return method(inner_config, *args, **kwargs)

    @classmethod
    @process_local
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        # No config to find the inner class from: the one last built in this process.
        # The API server builds none; the mirrored classes answer there (fault_mirror).
        inner = cls._last_inner_class
        return None if inner is None else inner.build_kv_connector_stats(data)

    # vLLM 0.34's additions, answered the same way on every vLLM (the base's default
    # where the inner connector predates them), so a wrapper never answers otherwise
    # than the connector it wraps.

    def may_load_async(self, request: Any) -> bool:
        """Whether the inner connector may load ``request`` asynchronously (0.34's
        ``--max-num-inflight-kv-loads`` queues by it). A load the wrapper itself turns
        async (``fault_mode``) is not announced: vLLM still caps it, and it waits for a
        running slot as the synchronous load it replaces would."""
        ask = getattr(self._inner, "may_load_async", None)
        if ask is not None:
            return bool(ask(request))
        params = getattr(request, "kv_transfer_params", None)
        return bool(params and params.get("do_remote_prefill"))

    supports_lookahead_block_hashes = class_forwarder(
        "supports_lookahead_block_hashes", "kv_transfer_config",
        default=lambda kv_transfer_config: False)

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """How the inner connector's workers reach the KV cache: vLLM's own answer for
        the inner config (its factory's, which also knows LMCache's legacy case)."""
        settings = cls.parse(extra_config(kv_transfer_config))
        inner_config = inner_transfer_config(kv_transfer_config, settings)
        ask = getattr(KVConnectorFactory, "kv_cache_access", None)
        if ask is not None:
            return ask(inner_config)
        inner = inner_class(kv_transfer_config, settings)
        if hasattr(inner, "kv_cache_access"):
            return inner.kv_cache_access(inner_config)
        try:
            # attr-defined: vLLM 0.34 added it; on the version mypy checks against, the
            # import fails and is answered below.
            from vllm.config.kv_transfer import KVCacheAccess  # type: ignore[attr-defined]
        except ImportError:
            return None  # a vLLM without the question
        return KVCacheAccess.IN_PROCESS

install(FaultInjectingConnector)


def fault_injecting(inner: type[KVConnectorBase_V1]) -> type[FaultInjectingConnector]:
    """The mirrored wrapper of a connector class that is not registered with vLLM.
    Assign it in the connector's own module under its name, and name it as vLLM names
    any external connector::

        FaultInjectingMyConnector = fault_injecting(MyConnector)  # in my_module

        --kv-transfer-config '{"kv_connector": "FaultInjectingMyConnector",
          "kv_connector_module_path": "my_module", ...}'
    """
    mirrored = fault_mirror.mirror_of(FaultInjectingConnector, inner)
    return cast("type[FaultInjectingConnector]", mirrored)  # a subclass of the base given


def __getattr__(name: str) -> Any:
    """``FaultInjecting<registered connector>``: the mirrored class, built on first lookup
    (see :mod:`kvmetrics.faults.fault_mirror`)."""
    return fault_mirror.resolve(FaultInjectingConnector, name)
