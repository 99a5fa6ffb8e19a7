"""Every vLLM method the instrumented scheduler hooks, with the signature it expects.

vLLM's scheduler internals change between releases. Rather than failing inside
``schedule()`` when one does, :class:`InstrumentedMixin` checks this table once at
construction: each method must exist and its leading parameters must carry the
names listed here (later parameters are fine if they have defaults, and are
passed through untouched). A hook that fails the check is left out; only the
counter families that need it stop counting, one log line names it, and
``kvmetrics_instrumentation_errors_total{hook}`` shows it on the endpoint. A hook
that raises at run time takes the same path from then on (:mod:`.state`): turned
off, counted once, logged once, its families taken off the page.

The hooks also read vLLM state (queues, the cache's usage, fields of the connector's
output); :data:`ATTRIBUTES` lists those reads and is checked the same way, so a
renamed attribute is found once at start instead of raising on every step.

Differences between the supported vLLM releases (0.28 to 0.34) are not errors:
an attribute may list the older names it had (``kv_holding_waiting``, called
``skipped_waiting`` before 0.31), and a hook on a path an older vLLM does not have
(``_handle_failed_recving``, from 0.30: before it there is no
``KVConnectorOutput.failed_recving`` and a failed async load goes through
``_update_requests_with_invalid_blocks``, which is hooked) is simply not needed.

The label values of that counter are :data:`kvmetrics.metrics.catalogue.HOOKS`;
a test keeps them equal to the names in both tables.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmetrics.metrics import catalogue as cat

#: Where a hooked method lives, relative to the scheduler instance.
OWNERS = ("scheduler", "kv_cache_manager", "block_pool", "connector")


@dataclass(frozen=True)
class Hook:
    owner: str
    method: str
    #: Leading parameters after ``self``, by name, in order.
    params: tuple[str, ...]
    #: Counter families (catalogue names) computed from what this hook sees.
    families: tuple[str, ...]
    #: Only checked when the scheduler has a KV connector.
    needs_connector: bool = False
    #: A ``KVConnectorOutput`` field that feeds this method: a vLLM without the field
    #: has no such path, so the method missing there is expected, not an error.
    fed_by_output_field: str | None = None

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.method}"


@dataclass(frozen=True)
class Attribute:
    """vLLM state a hook reads (not calls): it must exist after the scheduler is built."""

    #: ``scheduler``, ``kv_cache_manager``, ``block_pool`` (instances) or
    #: ``kv_connector_output`` (a field of vLLM's dataclass).
    owner: str
    #: Its names, newest first: the first one present is the one read.
    names: tuple[str, ...]
    families: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.names[0]}"


_LOOKUPS = (cat.PREFIX_CACHE_QUERY_TOKENS.name, cat.PREFIX_CACHE_HIT_TOKENS.name,
            cat.PROMPT_TOKENS.name)
_RECOVERY = (cat.ROLLED_BACK_TOKENS.name, cat.KV_LOAD_FAILED_REQUESTS.name,
             cat.RECOMPUTED_TOKENS.name)
#: kvmetrics' own health (errors, CPU time) and its exporter's (series dropped for
#: their labels, unreadable multiprocess files) are never switched off by a broken hook.
_OWN = (cat.INSTRUMENTATION_ERRORS, cat.INSTRUMENTATION_CPU, cat.SERIES_OVERFLOW,
        cat.SCRAPE_ERRORS)
_GAUGES = (cat.KV_CACHE_USAGE.name, cat.KV_CACHE_BLOCKS.name, cat.REQUESTS.name)
_EVERY = tuple(s.name for s in cat.COUNTERS if s not in _OWN) + (
    cat.RECOVERY_DURATION.name,) + _GAUGES

HOOKS: tuple[Hook, ...] = (
    Hook("scheduler", "schedule", (), (cat.KV_LOAD_BLOCKS.name, cat.RECOMPUTED_TOKENS.name)),
    # Every step's events (and gauges) are recorded at its end: nothing counts without it.
    Hook("scheduler", "update_from_output", ("scheduler_output", "model_runner_output"),
         _EVERY),
    Hook("scheduler", "_preempt_request", ("request", "timestamp"),
         (cat.PREEMPTIONS.name, cat.RECOMPUTED_TOKENS.name)),
    Hook("scheduler", "_free_request", ("request",), (cat.FINISHED_REQUESTS.name,)),
    Hook("scheduler", "_handle_invalid_blocks", ("invalid_block_ids", "num_scheduled_tokens"),
         (cat.RECOVERY_DURATION.name,)),
    Hook("scheduler", "_update_requests_with_invalid_blocks",
         ("requests", "invalid_block_ids", "num_scheduled_tokens", "evict_blocks"), _RECOVERY),
    Hook("scheduler", "_handle_failed_recving", ("failed_req_ids",), _RECOVERY,
         fed_by_output_field="failed_recving"),
    Hook("kv_cache_manager", "record_prefix_cache_stats", ("request", "num_hits"),
         _LOOKUPS + (cat.KV_LOAD_BLOCKS.name,)),
    Hook("kv_cache_manager", "evict_blocks", ("block_ids",), (cat.EVICTED_BLOCKS.name,)),
    Hook("kv_cache_manager", "reset_prefix_cache", (), (cat.EVICTED_BLOCKS.name,)),
    Hook("block_pool", "_maybe_evict_cached_block", ("block",), (cat.EVICTED_BLOCKS.name,)),
    Hook("connector", "update_state_after_alloc", ("request", "blocks", "num_external_tokens"),
         _LOOKUPS + (cat.KV_LOAD_BLOCKS.name,), needs_connector=True),
)

#: Requests held back while their KV arrives; ``skipped_waiting`` before vLLM 0.31.
HOLDING_WAITING = Attribute("scheduler", ("kv_holding_waiting", "skipped_waiting"), _GAUGES)
GAUGE_FAMILIES = _GAUGES

ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute("scheduler", ("requests",), (cat.KV_LOAD_BLOCKS.name,) + _RECOVERY),
    Attribute("scheduler", ("running",), _GAUGES),
    Attribute("scheduler", ("waiting",), _GAUGES),
    HOLDING_WAITING,
    Attribute("scheduler", ("recompute_kv_load_failures",), _RECOVERY),
    Attribute("kv_cache_manager", ("usage",), _GAUGES),
    Attribute("block_pool", ("num_gpu_blocks",), _GAUGES),
    Attribute("block_pool", ("blocks",), (cat.EVICTED_BLOCKS.name,)),
    Attribute("kv_connector_output", ("invalid_block_ids",),
              (cat.KV_LOAD_BLOCKS.name,) + _RECOVERY),
    Attribute("kv_connector_output", ("finished_recving",), (cat.KV_LOAD_BLOCKS.name,)),
)

_ENTRIES: tuple[Hook | Attribute, ...] = (*HOOKS, *ATTRIBUTES)
BY_NAME: dict[str, Hook | Attribute] = {entry.name: entry for entry in _ENTRIES}


def argument(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str,
             default: Any = None) -> Any:
    """An overridden method's argument by position or keyword, as vLLM passed it."""
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def vllm_base(cls: type) -> type:
    """vLLM's scheduler class under kvmetrics' mixins in ``cls``'s MRO (the first class
    after them that kvmetrics did not define), whose methods the overrides rely on."""
    def ours(c: type) -> bool:
        return c.__module__.startswith("kvmetrics.")

    mro = cls.__mro__
    first = next(i for i, c in enumerate(mro) if ours(c))
    return next(c for c in mro[first:] if not ours(c))


def owner_class(scheduler: Any, owner: str, base: type) -> type:
    """The class whose method is hooked: vLLM's own scheduler class for scheduler methods
    (``base``, so our overrides are not what gets checked), else the helper object's
    class (so the wrappers we install on the instance are not either)."""
    if owner == "scheduler":
        return base
    if owner == "kv_cache_manager":
        return type(scheduler.kv_cache_manager)
    if owner == "block_pool":
        return type(scheduler.kv_cache_manager.block_pool)
    return type(scheduler.connector)


def signature_problem(fn: Callable[..., Any] | None, hook: Hook, unbound: bool) -> str | None:
    """Why ``fn`` does not match ``hook`` (None when it does)."""
    if fn is None or not callable(fn):
        return "missing"
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return "signature unreadable"
    if unbound and params:
        params = params[1:]  # self
    positional = [p for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = tuple(p.name for p in positional[:len(hook.params)])
    if names != hook.params:
        return f"expected parameters {hook.params}, found {tuple(p.name for p in positional)}"
    for p in positional[len(hook.params):]:
        if p.default is p.empty:
            return f"new required parameter {p.name!r}"
    if any(p.kind == p.KEYWORD_ONLY and p.default is p.empty for p in params):
        return "new required keyword-only parameter"
    return None


def output_fields() -> frozenset[str]:
    """The fields of this vLLM's ``KVConnectorOutput``."""
    import dataclasses

    from vllm.v1.outputs import KVConnectorOutput

    return frozenset(f.name for f in dataclasses.fields(KVConnectorOutput))


def check_hooks(scheduler: Any, base: type) -> dict[str, str]:
    """``{hook name: problem}`` for every hook that cannot be used on this scheduler."""
    problems: dict[str, str] = {}
    has_connector = getattr(scheduler, "connector", None) is not None
    fields = output_fields()
    for hook in HOOKS:
        if hook.needs_connector and not has_connector:
            continue
        try:
            owner = owner_class(scheduler, hook.owner, base)
        except AttributeError as e:
            problems[hook.name] = f"owner missing ({e})"
            continue
        fn = getattr(owner, hook.method, None)
        if fn is None and hook.fed_by_output_field not in (None, *fields):
            continue  # an older vLLM without this path: nothing to count there
        problem = signature_problem(fn, hook, unbound=True)
        if problem is not None:
            problems[hook.name] = problem
    for attribute in ATTRIBUTES:
        if resolve_attribute(scheduler, attribute, fields) is None:
            problems[attribute.name] = "missing (looked for " + ", ".join(attribute.names) + ")"
    return problems


def resolve_attribute(scheduler: Any, attribute: Attribute,
                      fields: frozenset[str] | None = None) -> str | None:
    """The name ``attribute`` has in this vLLM (None: none of its names exists)."""
    if attribute.owner == "kv_connector_output":
        present = output_fields() if fields is None else fields
        return next((n for n in attribute.names if n in present), None)
    try:
        if attribute.owner == "scheduler":
            owner = scheduler
        elif attribute.owner == "kv_cache_manager":
            owner = scheduler.kv_cache_manager
        else:
            owner = scheduler.kv_cache_manager.block_pool
    except AttributeError:
        return None
    return next((n for n in attribute.names if hasattr(owner, n)), None)


def disabled_families(broken: set[str] | dict[str, str]) -> frozenset[str]:
    """Counter families that must stop counting when these hooks are out."""
    return frozenset(f for name in broken for f in BY_NAME[name].families)
