"""One step's forward pass as index tensors: who writes which KV rows, who reads which.

The runner turns the scheduled requests into *segments* (a request's token range
this step) and lays them end to end as rows, so that ground truth is computed,
written and compared for all requests at once, with no per-token Python loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmetrics.lab.engine.outputs import SchedulerOutput
from kvmetrics.lab.kv.cache import token_slots
from kvmetrics.lab.kv.ground_truth import PrefixDigestCache
from kvmetrics.lab.kv.verify import ReadSpan


@dataclass(slots=True)
class Segment:
    """A scheduled request's part of the step: it computes ``[computed, end)`` and reads
    ``[0, end)`` through ``block_ids``."""

    request_id: str
    block_ids: list[int]
    computed: int
    end: int
    #: Compare its whole read with ground truth this step.
    verify: bool
    #: It read a block reported invalid in this step: the recovery path discards its
    #: output (not verified), and what it computes is garbage (tainted).
    discarded: bool

    @property
    def first_row(self) -> int:
        """First position that gets a row: 0 when its whole read is verified."""
        return 0 if self.verify else self.computed


def segments_of(out: SchedulerOutput, invalid: set[int], block_size: int,
                select: Callable[[int, str], bool]) -> list[Segment]:
    """The step's segments; ``select(step, request_id)`` says whom to verify."""
    segments = []
    for sched in out.scheduled:
        c = sched.num_computed_tokens
        end = c + sched.num_scheduled_tokens
        if end <= 0:
            continue
        # The blocks it holds KV in from before this step: exactly those the
        # recovery path scans for failed blocks.
        read_before = sched.block_ids[:-(-c // block_size)]
        discarded = bool(invalid) and any(b in invalid for b in read_before)
        verify = not discarded and select(out.step, sched.request_id)
        segments.append(Segment(sched.request_id, sched.block_ids, c, end, verify, discarded))
    return segments


@dataclass
class StepBatch:
    #: Prefix digests of every row (CPU), for ground truth in one call.
    digests: torch.Tensor
    #: Cache slot of every row (device).
    slots: torch.Tensor
    #: Rows written this step (device) and, among them, those to poison (CPU bool).
    write_rows: torch.Tensor
    taint: torch.Tensor
    #: Rows read and compared (device), and the reads they come from.
    verify_rows: torch.Tensor
    spans: list[ReadSpan]

    @classmethod
    def build(cls, segments: list[Segment], digests: PrefixDigestCache, block_size: int,
              device: torch.device, taint_discarded: bool) -> StepBatch:
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in
                                                 ("digests", "slots", "write", "taint", "verify")}
        spans: list[ReadSpan] = []
        offset = 0
        for seg in segments:
            lo = seg.first_row
            n = seg.end - lo
            positions = torch.arange(lo, seg.end, dtype=torch.int64)
            table = torch.tensor(seg.block_ids, dtype=torch.int64)
            parts["digests"].append(digests.get(seg.request_id, seg.end)[lo:])
            parts["slots"].append(token_slots(table, positions, block_size))
            first_write = offset + seg.computed - lo
            parts["write"].append(torch.arange(first_write, offset + n, dtype=torch.int64))
            parts["taint"].append(torch.full((offset + n - first_write,),
                                             seg.discarded and taint_discarded))
            if seg.verify:
                parts["verify"].append(torch.arange(offset, offset + n, dtype=torch.int64))
                spans.append(ReadSpan(seg.request_id, seg.block_ids, seg.end))
            offset += n

        def cat(key: str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.cat(parts[key]) if parts[key] else torch.empty(0, dtype=dtype)

        return cls(
            digests=cat("digests"),
            slots=cat("slots").to(device, non_blocking=True),
            write_rows=cat("write").to(device, non_blocking=True),
            taint=cat("taint", torch.bool),
            verify_rows=cat("verify").to(device, non_blocking=True),
            spans=spans,
        )
