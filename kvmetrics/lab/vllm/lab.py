"""The lab's ``--engine vllm``: vLLM's real scheduler driven by the lab's data plane.

Registered with the lab through the ``kvmetrics.lab_engines`` entry point group
(``pyproject.toml``); the lab loads this module only when a run asks for it.
"""

from __future__ import annotations

from typing import Any

from kvmetrics.lab.config import VLLM_INSTALL_HINT, LabConfig, LabError
from kvmetrics.lab.engine.executor import worker_tokens
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.scheduler import SchedulerConfig

try:
    from kvmetrics.lab.vllm.engine import VllmEngine
except ImportError as e:  # the lab shows this message as its one-line error
    raise ImportError(f"vLLM is not installed ({e}); {VLLM_INSTALL_HINT}") from e
from kvmetrics.lab.engine_registry import EOS_PROBABILITY, make_request, make_runner
from kvmetrics.lab.workload import WorkItem
from kvmetrics.metrics.events import StepEvents


class VllmLabEngine:
    kind = "vllm"

    def __init__(self, cfg: LabConfig, sched_cfg: SchedulerConfig, faults: FaultPlan) -> None:
        if cfg.accounting != "unified":
            raise LabError("--accounting historical needs --engine reference "
                           "(vLLM 0.33 only has the unified accounting)")
        capacity = cfg.store_capacity
        self.store = ExternalStoreIndex(capacity) if capacity else None
        self.runner = make_runner(cfg, faults, self.store, worker_tokens(
            self._prompt, lambda rid: self.engine.requests[rid].num_prompt_tokens,
            EOS_PROBABILITY))
        # --recovery evict: vLLM's scheduler with kvmetrics' protective mode on.
        self.engine = VllmEngine(sched_cfg, self.runner, store=self.store,
                                 load_mode=cfg.fault_mode, seed=cfg.seed,
                                 recovery=cfg.recovery)

    def _prompt(self, request_id: str, start: int, end: int) -> list[int]:
        tokens = self.engine.requests[request_id].prompt_token_ids
        if tokens is None:
            raise ValueError(f"request {request_id!r} has no prompt token ids")
        return list(tokens[start:end])

    def add(self, item: WorkItem, max_tokens: int | None) -> None:
        self.engine.add_request(make_request(item, max_tokens))

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def step(self) -> int:
        record = self.engine.step()
        return record.output.total_num_scheduled_tokens if record is not None else 0

    def busy(self) -> bool:
        return self.engine.busy()

    def drain_events(self) -> list[StepEvents]:
        return self.engine.drain_events()

    def num_unfinished(self) -> int:
        return self.engine.scheduler.get_num_unfinished_requests()

    def close(self) -> None:
        self.engine.close()

    @property
    def findings(self) -> list[Any]:
        return list(getattr(self.runner, "findings", []))
