"""The test bench the defect canaries run on: vLLM's own scheduler, a scripted connector.

:func:`bench` builds the *installed* vLLM's ``Scheduler`` or ``AsyncScheduler`` (or
those of a :class:`Target`: a patched copy, kvmetrics' protective scheduler) with a
:class:`ScriptedConnector` that offers exactly the external tokens a scenario
scripts; :class:`Bench` plays the worker with hand-built ``ModelRunnerOutput``
objects, in the style of vLLM's ``tests/v1/kv_connector/unit``. The scenarios
themselves are in :mod:`kvmetrics.lab.vllm.canaries`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

BLOCK = 16


@dataclass(frozen=True)
class Target:
    """The scheduler classes the canaries run on: vLLM's own by default. Tests point
    them at a patched or protected scheduler to see a canary report a fix."""

    scheduler: str | type = "vllm.v1.core.sched.scheduler.Scheduler"
    async_scheduler: str | type = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
    kvmetrics_settings: tuple[tuple[str, Any], ...] = ()


VLLM = Target()
#: kvmetrics' instrumented scheduler with the protective recovery on
#: (``KVMETRICS_RECOVERY=evict``, export off): every canary reports its defect fixed.
PROTECTED = Target("kvmetrics.vllm.scheduler.InstrumentedScheduler",
                   "kvmetrics.vllm.scheduler.InstrumentedAsyncScheduler",
                   (("export", False), ("recovery", "evict")))
_target = VLLM


class ScenarioError(RuntimeError):
    """The scenario did not reach the state the canary inspects (vLLM changed)."""


# -- the scripted connector ------------------------------------------------------------


class _NoMetadata(KVConnectorMetadata):
    """Nothing to tell a worker: the canaries play the worker themselves."""


class ScriptedConnector(KVConnectorBase_V1):
    """Offers the external tokens a canary scripts, per request, and loads nothing.

    ``offers[request_id] = (tokens, load_async)``: tokens counted from the start of
    the prompt; a local hit is subtracted, as a store connector does.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.offers: dict[str, tuple[int, bool]] = {}

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens, load_async = self.offers.get(request.request_id, (0, False))
        extra = max(tokens - num_computed_tokens, 0)
        return extra, load_async and extra > 0

    def may_load_async(self, request: Any) -> bool:
        """Whether this request's offer is an async load (vLLM 0.34 asks, with
        ``max_num_inflight_kv_loads`` set, as a request enters the waiting queues)."""
        return self.offers.get(request.request_id, (0, False))[1]

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _NoMetadata()

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None


# -- a scheduler on a test bench ---------------------------------------------------------


@dataclass
class Bench:
    """vLLM's scheduler plus the few helpers every canary needs."""

    sched: Any
    hasher: Any
    requests: dict[str, Any] = field(default_factory=dict)

    @property
    def connector(self) -> ScriptedConnector:
        return self.sched.connector

    def add(self, request_id: str, tokens: list[int], max_tokens: int = 4,
            offer: int = 0, load_async: bool = False) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(request_id=request_id, prompt_token_ids=list(tokens),
                          sampling_params=SamplingParams(max_tokens=max_tokens),
                          pooling_params=None, block_hasher=self.hasher)
        if offer:
            self.connector.offers[request_id] = (offer, load_async)
        self.requests[request_id] = request
        self.sched.add_request(request)
        return request

    def blocks(self, request_id: str) -> list[int]:
        (ids,) = self.sched.kv_cache_manager.get_block_ids(request_id)
        return list(ids)

    def hashed(self, block_id: int) -> bool:
        return self.sched.kv_cache_manager.block_pool.blocks[block_id].block_hash is not None

    def execute(self, out: Any) -> Step:
        """The worker runs the step now (it sees the request as scheduled): whoever
        reaches the end of its known tokens samples one token (token id 7)."""
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[7] if self.requests[r].num_computed_tokens >= self.requests[r].num_tokens
                   else [] for r in req_ids]
        return Step(out, req_ids, sampled)

    def update(self, step: Step, *, invalid: Iterable[int] = (),
               finished_recving: Iterable[str] = ()) -> None:
        """Hand the step's output to the scheduler; ``invalid`` blocks failed to load."""
        from vllm.v1.outputs import KVConnectorOutput

        from kvmetrics.lab.vllm.compat import runner_output

        invalid, recving = set(invalid), set(finished_recving)
        kv_out = (KVConnectorOutput(invalid_block_ids=invalid,
                                    finished_recving=recving or None)
                  if invalid or recving else None)
        self.sched.update_from_output(step.out, runner_output(
            req_ids=step.req_ids, sampled_token_ids=step.sampled, kv_connector_output=kv_out))

    def step(self, **failures: Any) -> Any:
        """Lockstep: schedule, execute, update; returns vLLM's scheduler output."""
        out = self.sched.schedule()
        self.update(self.execute(out), **failures)
        return out


@dataclass
class Step:
    out: Any
    req_ids: list[str]
    sampled: list[list[int]]


def bench(policy: str = "recompute", num_gpu_blocks: int = 64, *, async_scheduling: bool = False,
          long_prefill_token_threshold: int = 0, max_model_len: int = 1024,
          max_num_batched_tokens: int = 256,
          scheduler_options: dict[str, Any] | None = None) -> Bench:
    """vLLM's own scheduler with the scripted connector (``kv_both``) and vLLM's defaults
    (``scheduler_options``: more of vLLM's ``SchedulerConfig`` fields)."""
    from kvmetrics.lab.engine.config import SchedulerConfig
    from kvmetrics.lab.vllm import builder

    config = SchedulerConfig(block_size=BLOCK, num_gpu_blocks=num_gpu_blocks, max_num_seqs=8,
                             max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len,
                             kv_load_failure_policy=policy, async_scheduling=async_scheduling,
                             long_prefill_token_threshold=long_prefill_token_threshold)
    connector = builder.ConnectorSpec(name=ScriptedConnector.__name__, module_path=__name__)
    sched = builder.build_scheduler(
        config, connector=connector,
        scheduler_cls=_target.async_scheduler if async_scheduling else _target.scheduler,
        kvmetrics_settings=dict(_target.kvmetrics_settings) or None,
        scheduler_options=scheduler_options)
    if not isinstance(sched.connector, ScriptedConnector):
        raise ScenarioError("vLLM did not build the scripted connector")
    return Bench(sched, builder.block_hasher_for(sched.vllm_config))


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise ScenarioError(f"scenario did not reach its state: {what}")


def request_status(name: str) -> Any:
    """vLLM's ``RequestStatus`` member of that name (imported late, as vLLM is)."""
    from vllm.v1.request import RequestStatus

    return getattr(RequestStatus, name)


@contextmanager
def on_target(target: Target) -> Iterator[None]:
    """Build every :func:`bench` inside on ``target``'s scheduler classes."""
    global _target
    _target = target
    try:
        yield
    finally:
        _target = VLLM
