"""Every hook, made to fail by hostile vLLM objects, leaves vLLM exactly as it was.

Generated from the hook table (``hooks.HOOKS``), not from a list: for each hook this
vLLM lets kvmetrics install, a fault workload runs on vLLM's real scheduler with the
hook *armed*: while kvmetrics' entry point for it runs (and not inside a nested hook),
every attribute kvmetrics' code reads on a vLLM object (requests, blocks, the connector
output, the cache manager, the scheduler's own vLLM state) raises AttributeError, as
after a rename, and so does every use of the recorder outside the guard machinery
(recorder.py, state.py, observe.py), as after a recorder bug. Then:

- vLLM's decisions (every step's scheduled tokens) and outputs equal an uninstrumented
  run's, and no exception reached the driver;
- the fault is counted once, under that hook (or, inside the output hook, under the
  gauges it reads), in ``kvmetrics_instrumentation_errors_total``, and logged once;
- the families that depend on the counted hooks are off the Prometheus page, while
  those that do not are still there.

A hook that no workload here reaches fails the test, so a new hook needs a workload.
"""

from __future__ import annotations

import contextlib
import os
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from kvmetrics.lab.engine.config import SchedulerConfig
from kvmetrics.lab.engine.executor import SimulatedExecutor
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.vllm.differential import random_workload, vllm_faithful
from kvmetrics.lab.vllm.engine import VllmEngine
from kvmetrics.metrics import catalogue as cat
from kvmetrics.vllm import hooks, recorder, state
from tests.test_vllm_hooks import kvmetrics_log

pytestmark = pytest.mark.vllm

OURS = os.path.dirname(os.path.abspath(state.__file__)) + os.sep
#: The guard machinery itself: it must work for a fault to be counted at all.
MACHINERY = tuple(OURS + name for name in ("recorder.py", "state.py", "observe.py"))
RECORDER_NAMES = frozenset(recorder.StepRecorder.__slots__) | frozenset(
    name for name, value in vars(recorder.StepRecorder).items() if callable(value))
#: vLLM's classes whose instances kvmetrics' hooks are handed or read.
VLLM_CLASSES = (
    ("vllm.v1.request", "Request"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheBlocks"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager"),
    ("vllm.v1.core.block_pool", "BlockPool"),
    ("vllm.v1.core.kv_cache_utils", "KVCacheBlock"),
    ("vllm.v1.outputs", "KVConnectorOutput"),
    ("vllm.v1.outputs", "ModelRunnerOutput"),
    ("vllm.v1.core.sched.output", "SchedulerOutput"),
)

CONFIG = vllm_faithful(SchedulerConfig(block_size=16, num_gpu_blocks=30, max_num_seqs=8,
                                       max_num_batched_tokens=128, max_model_len=1024,
                                       kv_load_failure_policy="recompute"))
WORKLOADS = ("sync-recompute", "sync-fail", "async-whole-request")


class Arming:
    """Which hook's entry point runs innermost, and the one whose reads are hostile."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.target: str | None = None

    def hostile(self) -> bool:
        return self.target is not None and bool(self.stack) and self.stack[-1] == self.target


ARMING = Arming()


def _hostile_getattribute(original: Callable[[Any, str], Any], recorder_only: bool):
    def __getattribute__(obj: Any, name: str) -> Any:
        if ARMING.hostile() and not name.startswith(("_kv", "kvmetrics", "__")):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(OURS) and not (recorder_only and (
                    caller in MACHINERY or name not in RECORDER_NAMES)):
                raise AttributeError(f"hostile: {type(obj).__name__}.{name}")
        return original(obj, name)

    return __getattribute__


@contextlib.contextmanager
def hostile_classes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import importlib

    for module, name in VLLM_CLASSES:
        cls = getattr(importlib.import_module(module), name, None)
        if cls is not None:
            monkeypatch.setattr(cls, "__getattribute__",
                                _hostile_getattribute(cls.__getattribute__, False))
    monkeypatch.setattr(Scheduler, "__getattribute__",
                        _hostile_getattribute(Scheduler.__getattribute__, False))
    monkeypatch.setattr(state.InstrumentState, "__getattribute__",
                        _hostile_getattribute(state.InstrumentState.__getattribute__, True))
    yield


def entry_owner(sched: Any, hook: hooks.Hook) -> Any:
    return {"scheduler": sched, "kv_cache_manager": sched.kv_cache_manager,
            "block_pool": sched.kv_cache_manager.block_pool,
            "connector": sched.connector}[hook.owner]


def installed(sched: Any) -> list[hooks.Hook]:
    """The table's hooks kvmetrics installed on this scheduler (this vLLM, this config)."""
    out = []
    for hook in hooks.HOOKS:
        owner = entry_owner(sched, hook)
        if owner is None or hook.name in sched._kv.off:
            continue
        vllm_method = getattr(hooks.vllm_base(type(sched)), hook.method, None) \
            if hook.owner == "scheduler" else vars(owner).get(hook.method)
        if vllm_method is not None:
            out.append(hook)
    return out


def trace_entries(sched: Any, seen: set[str]) -> None:
    """Put a layer in front of each installed hook's kvmetrics entry point, as vLLM
    calls it, that tells :data:`ARMING` which hook runs (and notes it in ``seen``)."""
    for hook in installed(sched):
        owner = entry_owner(sched, hook)
        entry = getattr(owner, hook.method)

        def traced(*args: Any, _entry=entry, _name=hook.name, **kwargs: Any) -> Any:
            seen.add(_name)
            ARMING.stack.append(_name)
            try:
                return _entry(*args, **kwargs)
            finally:
                ARMING.stack.pop()

        vars(owner)[hook.method] = traced


def run(workload: str, instrumented: bool, seen: set[str] | None = None) -> dict[str, Any]:
    """One fault workload; vLLM's decisions, outputs and (instrumented) the page."""
    config = replace(CONFIG, kv_load_failure_policy="fail") if workload == "sync-fail" \
        else CONFIG
    mode = "async" if workload.startswith("async") else "sync"
    spec = random_workload(4, 30, load_mode=mode)
    store = ExternalStoreIndex(spec.store_blocks)
    engine = VllmEngine(config, SimulatedExecutor(FaultPlan(rate=0.15, seed=4), store),
                        store=store, load_mode=mode,
                        scheduler_cls="instrumented" if instrumented else None,
                        kvmetrics_settings={"metrics_addr": "127.0.0.1:0", "model_name": "m"})
    for tokens in spec.warm:
        for h in engine.block_hashes(list(tokens)):
            store.insert(h)
    sched = engine.scheduler
    if seen is not None:
        trace_entries(sched, seen)
    decisions: list[dict[str, int]] = []
    schedule = sched.schedule

    def scheduling() -> Any:
        out = schedule()
        decisions.append(dict(out.num_scheduled_tokens))
        return out

    sched.schedule = scheduling
    if workload == "async-whole-request":
        execute = engine.adapter.execute
        failed_once: set[str] = set()

        def fail_whole_request(out: Any, scheduler: Any, *rest: Any) -> Any:
            record = execute(out, scheduler, *rest)
            kv_out = record.vllm_result.kv_connector_output
            if kv_out is not None and kv_out.finished_recving and not failed_once:
                failed_once.update(kv_out.finished_recving)
                kv_out.failed_recving = set(kv_out.finished_recving)
            return record

        engine.adapter.execute = fail_whole_request  # type: ignore[method-assign]
    pending = sorted(spec.requests, key=lambda r: r.arrival_step)
    steps = 0
    while pending or engine.busy():
        assert steps < 5000
        while pending and pending[0].arrival_step <= steps:
            engine.add_request(pending.pop(0).make())
        if steps == 12:
            sched.reset_prefix_cache()  # as vLLM's engine does on request
        engine.step()
        steps += 1
    page = ""
    if instrumented:
        port = sched.kvmetrics_exporter.server.port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            page = r.read().decode()
    outcomes = {rid: engine.outcome(rid) for rid in engine.requests}
    engine.close()
    return {"decisions": decisions, "outcomes": outcomes, "page": page}


def families_on(page: str) -> set[str]:
    """Families with at least one sample on the page."""
    names = {s.name: s for s in cat.ALL_METRICS}
    on = set()
    for line in page.splitlines():
        if line and not line.startswith("#"):
            sample = line.split("{")[0].split(" ")[0]
            for name, spec in names.items():
                if sample in spec.series_names() or sample.startswith(name + "_"):
                    on.add(name)
    return on


def errors_on(page: str, family: cat.MetricSpec = cat.INSTRUMENTATION_ERRORS,
              nonzero: bool = True) -> dict[str, float]:
    """The series (non-zero ones unless ``nonzero`` is False) of a family with one label
    of its own (``hook``, ``check``, ``family``)."""
    label = next(iter(family.labels))
    out = {}
    for line in page.splitlines():
        if line.startswith(family.name + "{"):
            value = float(line.rsplit(" ", 1)[1])
            if value or not nonzero:
                out[line.split(f'{label}="')[1].split('"')[0]] = value
    return out


_CLEAN: dict[str, Any] = {}


def clean(workload: str) -> dict[str, Any]:
    """The uninstrumented and the instrumented run of a workload, and the hooks it
    reaches (computed once per workload)."""
    if workload not in _CLEAN:
        seen: set[str] = set()
        _CLEAN[workload] = (run(workload, False), run(workload, True, seen), seen)
    return _CLEAN[workload]


def probe_hooks() -> list[str]:
    """The installed hooks of this vLLM (from the table, on a built scheduler)."""
    store = ExternalStoreIndex(64)
    engine = VllmEngine(CONFIG, SimulatedExecutor(None, store), store=store,
                        kvmetrics_settings={"metrics_addr": "off"})
    names = [hook.name for hook in installed(engine.scheduler)]
    engine.close()
    return names


@pytest.mark.parametrize("hook", probe_hooks())
def test_a_hostile_hook_never_reaches_vllm_and_takes_its_families_off(
        hook: str, monkeypatch: pytest.MonkeyPatch) -> None:
    workload = next((w for w in WORKLOADS if hook in clean(w)[2]), None)
    assert workload is not None, f"no workload here reaches {hook}: add one"
    plain, instrumented, _ = clean(workload)
    assert instrumented["outcomes"] == plain["outcomes"]
    assert errors_on(instrumented["page"]) == {}
    assert errors_on(instrumented["page"], cat.SELF_CHECK_FAILURES) == {}
    ARMING.target = hook
    try:
        with hostile_classes(monkeypatch), kvmetrics_log() as logged:
            hostile = run(workload, True, set())
    finally:
        ARMING.target = None
    # vLLM decided and produced exactly what it does alone.
    assert hostile["decisions"] == plain["decisions"]
    assert hostile["outcomes"] == plain["outcomes"]
    # Counted once, under the hook (or the gauges its step end reads), logged once.
    counted = errors_on(hostile["page"])
    allowed = {hook, state.GAUGES_HOOK} if hook == state.OUTPUT_HOOK else {hook}
    assert counted and set(counted) <= allowed and set(counted.values()) == {1}, counted
    for name in counted:
        assert len([line for line in logged if name in line]) == 1, logged
    # Its families are off the page; the others still on it.
    off = hooks.disabled_families(set(counted))
    on_before, on_now = families_on(instrumented["page"]), families_on(hostile["page"])
    assert not on_now & off, on_now & off
    assert on_before - off <= on_now, (on_before - off) - on_now
    # ...and the page says which, for the alert on an absent family.
    live = errors_on(hostile["page"], cat.FAMILY_LIVE, nonzero=False)
    assert {f for f, v in live.items() if v == 0} == off & set(live), live
