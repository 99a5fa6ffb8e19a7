"""Bookkeeping of external loads on the runner side: faults, misses and async completion.

Shared by the pure executor and the torch data plane so both report exactly the
same failed blocks and completions for the same schedule and fault plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.outputs import LoadSpec


@dataclass
class LoadOutcome:
    """One load's blocks split into those to copy (with store slots) and failures."""

    spec: LoadSpec
    copy: list[tuple[int, int]] = field(default_factory=list)  # (block_id, slot)
    failed: list[int] = field(default_factory=list)  # block ids


class TransferTracker:
    def __init__(self, faults: FaultPlan, store: ExternalStoreIndex,
                 async_delay_steps: int = 1) -> None:
        if async_delay_steps < 0:
            raise ValueError("async_delay_steps must be >= 0")
        self.faults = faults
        self.store = store
        self.async_delay_steps = async_delay_steps
        self._in_flight: list[tuple[int, LoadOutcome]] = []

    def resolve(self, step: int, spec: LoadSpec) -> LoadOutcome:
        outcome = LoadOutcome(spec)
        for offset, (block_id, block_hash) in enumerate(zip(spec.block_ids, spec.block_hashes,
                                                            strict=True)):
            slot = self.store.lookup(block_hash)
            if slot is None or self.faults.fails(step, spec.request_id,
                                                 spec.first_index + offset):
                outcome.failed.append(block_id)
            else:
                outcome.copy.append((block_id, slot))
        return outcome

    def start(self, step: int, loads: list[LoadSpec]) -> list[LoadOutcome]:
        """Resolve this step's loads; return the sync ones (async ones complete later)."""
        sync: list[LoadOutcome] = []
        for spec in loads:
            outcome = self.resolve(step, spec)
            if spec.mode == "sync":
                sync.append(outcome)
            else:
                self._in_flight.append((step + self.async_delay_steps, outcome))
        return sync

    def finish_due(self, step: int) -> list[LoadOutcome]:
        """Async loads whose transfer completes at this step."""
        due = [o for s, o in self._in_flight if s <= step]
        self._in_flight = [(s, o) for s, o in self._in_flight if s > step]
        return due

    @property
    def has_in_flight(self) -> bool:
        return bool(self._in_flight)
