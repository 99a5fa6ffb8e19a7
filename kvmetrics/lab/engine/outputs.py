"""What crosses between the scheduler and a model runner in one step.

Shaped after vLLM's SchedulerOutput / ModelRunnerOutput so that the same model
runner (the pure executor or the torch data plane) can serve both the reference
engine and vLLM's real scheduler through a thin adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmetrics.lab.engine.hashing import BlockHash
from kvmetrics.metrics.events import StepEvents


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    #: Tokens whose KV the request already has before this step.
    num_computed_tokens: int
    num_scheduled_tokens: int
    #: The request's whole block table after this step's allocation. A live view
    #: of the scheduler's table, valid until the next ``schedule()``: copy it to keep it.
    block_ids: list[int]
    #: Tokens the request knows at schedule time; a step that reaches this many
    #: computed tokens samples the next one.
    num_tokens: int


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """External blocks to load into the request's blocks ``first_index..``."""

    request_id: str
    mode: str  # "sync" | "async"
    first_index: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class BlockSave:
    """A block that becomes full and computed in this step: store it externally."""

    request_id: str
    block_index: int
    block_id: int
    block_hash: BlockHash


@dataclass
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    #: Earlier steps whose output the scheduler had not processed when it made this
    #: one (0 in lockstep, 1 under an async batch queue): a block one of them
    #: reported invalid was not known to be bad when this step was scheduled, so a
    #: read of it here is the recovery path's to discard, not a stale read.
    in_flight_steps: int = 0

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_scheduled_tokens for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    #: Blocks whose external load failed (sync: this step's loads; async: loads
    #: reported finished in ``finished_recving`` at the latest).
    invalid_block_ids: set[int] = field(default_factory=set)
    #: Requests whose async load finished (successfully or not) in this step.
    finished_recving: set[str] = field(default_factory=set)
    #: Events only the runner can see (verification), folded into the step's.
    events: StepEvents | None = None
