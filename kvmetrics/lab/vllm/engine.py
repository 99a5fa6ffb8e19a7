"""Drive vLLM's real scheduler with kvmetrics requests, runners and fault plans.

:class:`VllmEngine` has the surface of the reference engine's loop
(:class:`kvmetrics.lab.engine.loop.EngineLoop` around
:class:`kvmetrics.lab.engine.scheduler.Scheduler`): ``add_request``, ``abort``,
``step``, ``busy``, ``run``, ``drain_events``. Request ids are kept verbatim and
steps are numbered the same way, so a fault plan keyed by (step, request id,
block index) makes the same decisions on both engines.

With ``config.async_scheduling`` it drives vLLM's ``AsyncScheduler`` the way
vLLM's engine core does (``EngineCore.step_with_batch_queue``, a queue of two):
step n+1 is scheduled, and executed by the runner, before step n's output is
processed. The configuration vLLM gets then has ``max_concurrent_batches`` 2,
so with the built-in ``kv_both`` connector it defers block frees, exactly as a
GPU deployment does.
"""

from __future__ import annotations

import itertools
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request as VllmRequest

from kvmetrics.lab.engine.config import SchedulerConfig, check_fits
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.loop import BatchQueue, run_until_idle
from kvmetrics.lab.engine.request import Request
from kvmetrics.lab.vllm import builder
from kvmetrics.lab.vllm.runner import ModelRunner, StepRecord, VllmRunnerAdapter
from kvmetrics.lab.vllm.store_connector import register_store, unregister_store
from kvmetrics.metrics.events import StepEvents
from kvmetrics.metrics.pipeline import MetricsPipeline
from kvmetrics.vllm.recorder import FINISH_REASONS

_store_keys = itertools.count()

#: ``scheduler_cls`` default: the instrumented scheduler matching the configuration.
INSTRUMENTED = "instrumented"


class VllmEngine:
    """vLLM's scheduler (instrumented by default) plus a kvmetrics model runner.

    With ``store`` the built-in connector is configured (``load_mode`` sync,
    async or mixed) and shares that store with the runner. With ``pipeline``
    every completed step's events are recorded into it; otherwise they wait for
    :meth:`drain_events`. ``keep_records`` keeps each step's outputs for tests.
    ``kvmetrics_settings`` (see :mod:`kvmetrics.vllm.exporting`) lets
    the scheduler export by itself, as under ``vllm serve``; by default it does not.
    ``recovery="evict"`` turns on the instrumented scheduler's protective mode
    (:mod:`kvmetrics.protect.recovery`, ``KVMETRICS_RECOVERY=evict``).
    ``scheduler_cls=None`` runs vLLM's own class, uninstrumented.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        runner: ModelRunner,
        *,
        store: ExternalStoreIndex | None = None,
        load_mode: str = "sync",
        seed: int = 0,
        scheduler_cls: str | type | None = INSTRUMENTED,
        pipeline: MetricsPipeline | None = None,
        keep_records: bool = False,
        kvmetrics_settings: dict[str, Any] | None = None,
        recovery: str = "vllm",
    ) -> None:
        if config.accounting != "unified":
            raise ValueError("vLLM only has the unified accounting")
        self.config = config
        self.pipeline = pipeline
        self._store_key: str | None = None
        connector = None
        if store is not None:
            self._store_key = f"vllm-engine-{next(_store_keys)}"
            register_store(self._store_key, store)
            connector = builder.ConnectorSpec(
                extra={"store_key": self._store_key, "load_mode": load_mode, "seed": seed})
        if scheduler_cls == INSTRUMENTED:
            scheduler_cls = builder.instrumented_cls(config)
        settings: dict[str, object] = ({"export": False} if kvmetrics_settings is None
                                       else dict(kvmetrics_settings))
        if recovery != "vllm":
            settings["recovery"] = recovery
        self.scheduler = builder.build_scheduler(
            config, scheduler_cls=scheduler_cls, connector=connector,
            kvmetrics_settings=settings)
        self.hasher = builder.block_hasher_for(self.scheduler.vllm_config)
        self.adapter = VllmRunnerAdapter(runner, config.block_size)
        self.records: list[StepRecord] | None = [] if keep_records else None
        self.requests: dict[str, VllmRequest] = {}
        self._arrival = itertools.count()
        sched = self.scheduler
        self.batch_queue: BatchQueue | None = None
        if config.async_scheduling:
            self.batch_queue = BatchQueue(sched.schedule, self._execute, self._update,
                                          sched.has_requests,
                                          lambda out: out.total_num_scheduled_tokens)

    # -- requests --------------------------------------------------------------------

    def to_vllm_request(self, request: Request) -> VllmRequest:
        """The same request for vLLM: same id, tokens, length limit and stop token."""
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0)
        if request.eos_token_id is not None:
            params.update_from_generation_config({}, eos_token_id=request.eos_token_id)
        return VllmRequest(
            request_id=request.request_id,
            prompt_token_ids=request.token_ids(0, request.num_prompt_tokens),
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(next(self._arrival)),
            cache_salt=request.cache_salt,
            block_hasher=self.hasher,
        )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        check_fits(request.request_id, request.num_prompt_tokens, request.max_tokens,
                   self.config)
        vreq = self.to_vllm_request(request)
        self.requests[request.request_id] = vreq
        self.scheduler.add_request(vreq)

    def abort(self, request_id: str) -> bool:
        from vllm.v1.request import RequestStatus

        done = self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        return bool(done)

    def block_hashes(self, token_ids: list[int]) -> list[bytes]:
        """vLLM's block hashes of a prompt (e.g. to warm the external store)."""
        probe = VllmRequest(request_id="kvmetrics-probe", prompt_token_ids=list(token_ids),
                            sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                            block_hasher=self.hasher)
        return list(probe.block_hashes)

    def outcome(self, request_id: str) -> tuple[str | None, list[int]]:
        """Finish reason (reference names) and output tokens of a request."""
        vreq = self.requests[request_id]
        reason = FINISH_REASONS.get(vreq.status.name) if vreq.is_finished() else None
        return reason, list(vreq.output_token_ids)

    # -- loop ------------------------------------------------------------------------

    def _execute(self, out: Any) -> StepRecord:
        in_flight = len(self.batch_queue) if self.batch_queue is not None else 0
        record = self.adapter.execute(out, self.scheduler, in_flight)
        if self.records is not None:
            self.records.append(record)
        return record

    def _update(self, out: Any, record: StepRecord) -> None:
        sched = self.scheduler
        merge = getattr(sched, "kvmetrics_merge", None)
        if merge is not None:
            merge(record.result.events)
        sched.update_from_output(out, record.vllm_result)
        if self.pipeline is not None:
            for events in self.drain_events():
                self.pipeline.record(events)

    def step(self) -> StepRecord | None:
        """One engine step; returns the step it scheduled (None: it only processed one)."""
        if self.batch_queue is not None:
            started = self.batch_queue.step()
            return started[1] if started is not None else None
        out = self.scheduler.schedule()
        record = self._execute(out)
        self._update(out, record)
        return record

    def busy(self) -> bool:
        if self.batch_queue is not None:
            return bool(self.scheduler.has_requests() or self.batch_queue)
        return self.scheduler.has_unfinished_requests() or self.adapter.has_pending_work

    def run(self, max_steps: int = 1_000_000) -> int:
        """Step until every request finished; returns the steps taken."""
        return run_until_idle(self.step, self.busy, max_steps)

    def drain_events(self) -> list[StepEvents]:
        drain = getattr(self.scheduler, "drain_events", None)
        return drain() if drain is not None else []

    def close(self) -> None:
        if self._store_key is not None:
            unregister_store(self._store_key)
            self._store_key = None
        self.scheduler.shutdown()
