"""Run a workload through an engine with faults, metrics and progress: the lab's main loop."""

from __future__ import annotations

import random
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvmetrics.exporters.prometheus import (
    MetricsServer,
    PrometheusSink,
    parse_host_port,
    serve,
)
from kvmetrics.exporters.tls import TLSOptions
from kvmetrics.lab import synthetic
from kvmetrics.lab.config import LabConfig, LabError
from kvmetrics.lab.engine.config import RECOVERY_MODES, ConfigError, SchedulerConfig
from kvmetrics.lab.engine.faults import FaultPlan, FaultPlanError
from kvmetrics.lab.engine_registry import build_engine
from kvmetrics.lab.findings import explain_findings, explain_violations
from kvmetrics.lab.instrument import InstrumentedEngine
from kvmetrics.lab.kv_errors import is_verification_error
from kvmetrics.lab.progress import Progress
from kvmetrics.lab.summary import build_summary
from kvmetrics.lab.timeline import TimelineSink
from kvmetrics.lab.traces import load_trace
from kvmetrics.lab.workload import WorkItem
from kvmetrics.metrics.guard import CounterViolationError
from kvmetrics.metrics.logs import get_logger
from kvmetrics.metrics.pipeline import MetricsPipeline

log = get_logger("kvmetrics.lab")

#: Consecutive steps that schedule nothing while requests wait before a run is
#: declared stalled (async loads complete within a few steps; vLLM 0.33 can stall
#: for good, see docs/vllm.md).
STALL_STEPS = 1000


class EngineStalled(RuntimeError):
    """The engine stopped making progress with requests still unfinished."""


class Narrator:
    """What a run tells a person while it serves metrics (the CLI prints it on stderr;
    a library caller hears nothing). ``linger`` must wait ``seconds``."""

    def say(self, message: str) -> None:
        pass

    def linger(self, seconds: float) -> None:
        time.sleep(seconds)


@dataclass
class LabResult:
    summary: dict[str, Any]
    pipeline: MetricsPipeline
    prometheus: PrometheusSink
    findings: list[Any] = field(default_factory=list)
    timeline: TimelineSink | None = None
    config: LabConfig | None = None
    #: The signal that cut the run short (the summary covers the steps it ran).
    interrupted: int | None = None

    def document(self) -> dict[str, Any]:
        """The run as one JSON document: the summary, the configuration and the timeline
        (what ``--output`` writes and ``kvmetrics report`` reads)."""
        doc = dict(self.summary)
        if self.config is not None:
            doc["config"] = config_dict(self.config)
        if self.timeline is not None:
            doc["timeline"] = self.timeline.as_dict()
        return doc


@dataclass
class _LoopState:
    """How far the loop got: what an interrupted run's summary is built from."""

    start: float = field(default_factory=time.monotonic)
    executed: int = 0
    #: Requests handed to the engine: all of them unless the run was interrupted.
    arrived: int = 0


def config_dict(cfg: LabConfig) -> dict[str, Any]:
    """The settings that shape a run (not how it is watched: progress, serving, OTLP)."""
    skip = {"progress", "serve", "linger", "wait_for_scrape", "otlp_endpoint", "realtime"}
    return {k: v for k, v in asdict(cfg).items() if k not in skip}


def load_items(cfg: LabConfig) -> list[WorkItem]:
    if cfg.trace is not None:
        return load_trace(cfg.trace, cfg.trace_format, cfg.max_requests)
    n = cfg.max_requests or LabConfig.DEFAULT_SYNTHETIC_REQUESTS
    return synthetic.generate(cfg.workload, n, seed=cfg.seed)


def scheduler_config(cfg: LabConfig, items: list[WorkItem]) -> SchedulerConfig:
    """Size max_model_len to the workload and refuse requests the cache can never hold."""
    longest = 0
    usable = cfg.num_gpu_blocks - 1
    ids: set[str] = set()
    for item in items:
        if item.request_id in ids:  # an engine would refuse it mid-run, outputs unwritten
            raise LabError(f"request id {item.request_id[:60]!r} is given twice")
        ids.add(item.request_id)
        need = len(item.prompt) + (cfg.max_tokens or item.max_tokens)
        blocks = -(-need // cfg.block_size)
        if blocks > usable:
            raise LabError(
                f"request {item.request_id} needs {blocks} blocks of {cfg.block_size} tokens "
                f"but the cache holds {usable}; raise --num-gpu-blocks or --block-size")
        longest = max(longest, need)
    try:
        return SchedulerConfig(
            block_size=cfg.block_size, num_gpu_blocks=cfg.num_gpu_blocks,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=max(longest, cfg.block_size), kv_load_failure_policy=cfg.policy,
            accounting=cfg.accounting, **engine_fidelity(cfg))
    except ConfigError as e:
        raise LabError(str(e)) from None


def engine_fidelity(cfg: LabConfig) -> dict[str, Any]:
    """The scheduler settings that follow vLLM: its defaults, and its defects or the fix.

    ``--recovery vllm`` is vLLM 0.33 as it is, so the reference engine reproduces
    all six recovery-path defects of docs/vllm-defects.md (and both engines agree
    exactly); ``--recovery evict`` fixes all of them, on either engine.
    """
    return dict(recovery=cfg.recovery, async_scheduling=cfg.async_scheduling,
                **RECOVERY_MODES[cfg.recovery], reserve_full_prompt=cfg.reserve_full_prompt,
                long_prefill_token_threshold=cfg.long_prefill_token_threshold)


def fault_plan(cfg: LabConfig) -> FaultPlan:
    try:
        if cfg.fault_plan is not None:
            return FaultPlan.load(cfg.fault_plan)
        return FaultPlan(rate=cfg.fault_rate, seed=cfg.seed)
    except FaultPlanError as e:
        raise LabError(str(e)) from None


def _abort_schedule(cfg: LabConfig, items: list[WorkItem]) -> dict[str, int]:
    """Steps after arrival at which chosen requests are aborted (deterministic)."""
    rng = random.Random(cfg.seed ^ 0xAB0)
    return {item.request_id: rng.randint(1, cfg.abort_within_steps) for item in items
            if rng.random() < cfg.abort_rate}


def run_lab(cfg: LabConfig, items: list[WorkItem] | None = None,
            on_finished: Callable[[LabResult], None] | None = None,
            narrator: Narrator | None = None) -> LabResult:
    """Run a workload to the end. ``on_finished`` sees the result before ``--linger``
    starts, while the metrics are still served (the CLI writes its outputs there).

    On an interrupt (KeyboardInterrupt) during the steps, ``on_finished`` sees the
    result so far, with ``interrupted`` set, and the interrupt is raised again; on a
    stall likewise, with the summary's ``stalled`` saying where, then EngineStalled; on
    a ``--strict`` stop (a guard rejection, an invariant violation, a stale KV read)
    likewise, with ``stopped`` saying why, then the error."""
    narrator = narrator or Narrator()
    cfg.validate()
    if items is None:
        items = load_items(cfg)
    sched_cfg = scheduler_config(cfg, items)
    faults = fault_plan(cfg)
    engine = build_engine(cfg, sched_cfg, faults)

    prometheus = PrometheusSink()
    timeline = TimelineSink()
    sinks: list[Any] = [prometheus, timeline]
    provider = None
    if cfg.otlp_endpoint:
        from kvmetrics.exporters.otel import make_provider, otlp_reader, sink_for

        provider = make_provider([otlp_reader(cfg.otlp_endpoint)], model_name=cfg.model_name,
                                 engine="0", engine_kind=engine.kind)
        sinks.append(sink_for(provider))
    pipeline = MetricsPipeline(sinks, model_name=cfg.model_name, engine="0",
                               engine_kind=engine.kind, recovery=cfg.recovery,
                               strict=cfg.strict)
    instrumented = InstrumentedEngine(engine, pipeline)
    server: MetricsServer | None = None
    if cfg.serve:
        try:
            host, port = parse_host_port(cfg.serve)
            server = serve(prometheus.serving_registry(), host, port, tls=TLSOptions(
                certfile=cfg.serve_tls_cert, keyfile=cfg.serve_tls_key,
                client_cafile=cfg.serve_tls_client_ca))
        except (ValueError, OSError) as e:
            raise LabError(f"cannot serve metrics on {cfg.serve}: {e}") from None
        narrator.say(f"serving metrics on {_url(server)}")

    try:
        if server is not None and cfg.wait_for_scrape:
            narrator.say(f"waiting up to {cfg.wait_for_scrape:g} s for a first scrape of "
                         f"{_url(server)}")
            if not server.wait_for_scrape(cfg.wait_for_scrape):
                raise LabError(f"nothing scraped {_url(server)} within "
                               f"{cfg.wait_for_scrape:g} s (--wait-for-scrape)")
            narrator.say("scraped; starting the run")
        return _drive(cfg, items, instrumented, engine, pipeline, prometheus, timeline,
                      server, on_finished, narrator)
    finally:
        engine.close()
        if provider is not None:
            from kvmetrics.exporters.otel import SHUTDOWN_TIMEOUT_S, shutdown_provider

            if not shutdown_provider(provider):
                narrator.say(f"the OTLP collector at {cfg.otlp_endpoint} did not take the last "
                             f"push within {SHUTDOWN_TIMEOUT_S:g} s; it was dropped")
        if server is not None:
            server.stop()


def _url(server: MetricsServer) -> str:
    return server.url


def _drive(cfg: LabConfig, items: list[WorkItem], instrumented: InstrumentedEngine,
           engine: Any, pipeline: MetricsPipeline, prometheus: PrometheusSink,
           timeline: TimelineSink, server: MetricsServer | None,
           on_finished: Callable[[LabResult], None] | None, narrator: Narrator) -> LabResult:
    progress = Progress(len(items), enabled=cfg.progress)
    aborted: dict[str, int] = {}
    state = _LoopState()
    interrupt: BaseException | None = None
    try:
        _loop(cfg, items, instrumented, engine, timeline, progress, aborted, state)
    except (KeyboardInterrupt, EngineStalled, CounterViolationError) as e:
        interrupt = e  # the steps run so far are summarised and written, then it is raised
    except Exception as e:
        if not is_verification_error(e):  # --strict's stop at a stale read: kept likewise
            raise
        interrupt = e
    finally:
        progress.close()
    summary = build_summary(pipeline.totals, engine=engine.kind, submitted=state.arrived,
                            wall_seconds=time.monotonic() - state.start,
                            steps=state.executed)
    runner = getattr(engine, "runner", None)
    summary["findings"] = explain_findings(cfg, engine.findings,
                                           getattr(runner, "attributions", ()), aborted)
    summary["violations"] = explain_violations(pipeline.violations, pipeline.totals)
    result = LabResult(summary, pipeline, prometheus, engine.findings, timeline, cfg)
    if isinstance(interrupt, EngineStalled):
        summary["stalled"] = str(interrupt)
    elif isinstance(interrupt, Exception):
        summary["stopped"] = f"strict mode: {interrupt}"
    elif interrupt is not None:
        result.interrupted = int(getattr(interrupt, "signum", signal.SIGINT))
        summary["interrupted"] = signal.Signals(result.interrupted).name
    if server is not None:
        server.refresh()  # the final totals from now on, not a page cached before the end
    if on_finished is not None:
        on_finished(result)
    if interrupt is not None:
        raise interrupt
    if server is not None and cfg.linger > 0:
        narrator.linger(cfg.linger)
    return result


def _loop(cfg: LabConfig, items: list[WorkItem], instrumented: InstrumentedEngine,
          engine: Any, timeline: TimelineSink, progress: Progress,
          aborted: dict[str, int], state: _LoopState) -> None:
    """Feed arrivals and aborts, step until idle, counting steps in ``state``.
    ``aborted`` receives the requests the lab aborted, with the step."""
    pending = deque(sorted(items, key=lambda it: it.arrival_s))
    aborts_after = _abort_schedule(cfg, items)
    abort_at: dict[int, list[str]] = {}
    start = state.start
    clock = 0  # virtual step, advanced by executed and skipped steps
    executed = 0
    idle = 0
    while pending or engine.busy():
        if pending and not engine.busy():
            clock = max(clock, int(pending[0].arrival_s / cfg.step_seconds))
        while pending and int(pending[0].arrival_s / cfg.step_seconds) <= clock:
            item = pending.popleft()
            engine.add(item, cfg.max_tokens)
            state.arrived += 1
            delay = aborts_after.get(item.request_id)
            if delay is not None:
                abort_at.setdefault(clock + delay, []).append(item.request_id)
        for rid in abort_at.pop(clock, ()):
            if engine.abort(rid):
                aborted[rid] = executed + 1
        if cfg.realtime:
            lag = start + executed * cfg.step_seconds - time.monotonic()
            if lag > 0:
                time.sleep(lag)
        if engine.step() or not engine.busy():
            idle = 0
        else:
            idle += 1
            if idle > STALL_STEPS and not _arrivals_due(pending, clock, cfg):
                raise EngineStalled(f"the {engine.kind} engine stalled: {idle} steps in a row "
                               f"scheduled nothing with requests unfinished (step {executed})")
        instrumented.flush()
        clock += 1
        executed += 1
        state.executed = executed
        timeline.close_step(executed, time.monotonic() - start)
        done = state.arrived - engine.num_unfinished()
        progress.update(done, executed)
    progress.update(len(items), executed, force=True)


def _arrivals_due(pending: deque[WorkItem], clock: int, cfg: LabConfig) -> bool:
    return bool(pending) and int(pending[0].arrival_s / cfg.step_seconds) <= clock + 1
