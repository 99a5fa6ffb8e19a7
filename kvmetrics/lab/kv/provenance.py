"""Where bad KV came from: the data plane's record of every block it poisoned, and why.

The runner poisons KV in two ways, both on purpose: a block whose load failed is
filled with NaN (:data:`FAILED_LOAD`), and a request that read such a block in
the step it failed computed its own new KV over garbage, so what it wrote then is
NaN too (:data:`DISCARDED_READ`). Poisoned KV that reaches the external store and
is loaded back carries its origin along (:data:`FROM_STORE`). For each poisoned
block this module keeps the latest such event (cleared when the block is wholly
rewritten with good KV or loaded cleanly), and what happened next to the request
that owned it (preempted, or gone from the engine), so that a verifier finding
can be attributed to the event that made the KV bad rather than only reported.

Everything here runs off the hot path: with no poisoned block alive the runner
skips it, and otherwise it is a loop over the step's segments or loaded blocks,
never over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAILED_LOAD = "failed_load"
DISCARDED_READ = "discarded_read"
FROM_STORE = "from_store"


@dataclass(frozen=True, slots=True)
class Taint:
    """One event that made a block's KV bad."""

    kind: str
    step: int
    #: The block's owner at that time: whose load failed, or who computed over bad KV.
    request_id: str
    #: The block's index in the owner's block table.
    block_index: int
    #: What it derives from (the failed load a discarded read saw, or the taint of the
    #: block that was saved to the store); None for a failed load.
    source: Taint | None = None

    @property
    def root(self) -> Taint:
        taint = self
        while taint.source is not None:
            taint = taint.source
        return taint


@dataclass(frozen=True, slots=True)
class Fate:
    """Something that happened to a taint's owner: ``preempted`` or ``finished`` (left the
    engine: finished, failed or aborted) at ``step``."""

    step: int
    what: str


@dataclass(frozen=True, slots=True)
class Attribution:
    """What the data plane knows about the KV behind one finding."""

    #: The last event that poisoned the block read, or None if the data plane never
    #: poisoned it (then the cause lies elsewhere: a hash collision, a block handed on
    #: while an async load was still landing in it, ...).
    taint: Taint | None
    #: What happened to the taint's owner between that event and the read.
    owner_fates: tuple[Fate, ...] = ()


@dataclass
class Provenance:
    blocks: dict[int, Taint] = field(default_factory=dict)
    slots: dict[int, Taint] = field(default_factory=dict)
    fates: dict[str, list[Fate]] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.blocks or self.slots)

    def _own(self, taint: Taint) -> None:
        self.fates.setdefault(taint.request_id, [])

    def failed_load(self, block_id: int, step: int, request_id: str, block_index: int) -> None:
        taint = Taint(FAILED_LOAD, step, request_id, block_index)
        self.blocks[block_id] = taint
        self._own(taint)

    def loaded(self, block_id: int, slot: int, step: int, request_id: str,
               block_index: int) -> None:
        """A clean load of ``slot`` into ``block_id``: the block is what the slot holds."""
        source = self.slots.get(slot)
        if source is None:
            self.blocks.pop(block_id, None)
            return
        taint = Taint(FROM_STORE, step, request_id, block_index, source)
        self.blocks[block_id] = taint
        self._own(taint)

    def discarded_write(self, block_id: int, step: int, request_id: str, block_index: int,
                        read: Taint | None) -> None:
        taint = Taint(DISCARDED_READ, step, request_id, block_index, read)
        self.blocks[block_id] = taint
        self._own(taint)

    def rewritten(self, block_id: int) -> None:
        """Every token of the block was written with good KV."""
        self.blocks.pop(block_id, None)

    def saved(self, slot: int, block_id: int) -> None:
        taint = self.blocks.get(block_id)
        if taint is None:
            self.slots.pop(slot, None)
        else:
            self.slots[slot] = taint

    def note(self, step: int, preempted: set[str], finished: set[str]) -> None:
        """Record what happened this step to requests that own a taint."""
        if not self.fates:
            return
        for rid in preempted:
            if rid in self.fates:
                self.fates[rid].append(Fate(step, "preempted"))
        for rid in finished:
            if rid in self.fates:
                self.fates[rid].append(Fate(step, "finished"))

    def attribute(self, block_id: int, step: int) -> Attribution:
        taint = self.blocks.get(block_id)
        if taint is None:
            return Attribution(None)
        fates = tuple(f for f in self.fates.get(taint.request_id, ())
                      if taint.step <= f.step <= step)
        return Attribution(taint, fates)
