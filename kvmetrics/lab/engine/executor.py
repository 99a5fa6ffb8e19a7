"""A model runner without tensors: loads, faults, saves and deterministic sampling.

The pure engine uses it for fast fault sweeps and tests; the torch data plane in
:mod:`kvmetrics.lab.kv` does the same bookkeeping plus real KV and verification.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable

from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.outputs import ModelRunnerOutput, SchedulerOutput
from kvmetrics.lab.engine.tokens import VOCAB_SIZE, mix64
from kvmetrics.lab.engine.transfers import TransferTracker

#: Token id the sampler emits to stop a request (requests opt in via eos_token_id).
EOS_TOKEN_ID = VOCAB_SIZE


def request_seed(request_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")


def sample_token(seed: int, position: int, eos_probability: float = 0.0) -> int:
    """The next token of a request at ``position``: a pure function, so runs repeat."""
    x = mix64(seed ^ (position * 0x9E3779B97F4A7C15 & ((1 << 64) - 1)))
    if eos_probability > 0 and (x >> 40) / 2**24 < eos_probability:
        return EOS_TOKEN_ID
    return x % VOCAB_SIZE


def worker_tokens(prompt: Callable[[str, int, int], list[int]],
                  prompt_length: Callable[[str], int],
                  eos_probability: float = 0.0) -> Callable[[str, int, int], list[int]]:
    """The tokens a worker has at each position: the prompt, then what it sampled.

    A data plane computes KV from these, not from the scheduler's request: under
    async scheduling a step computes the token the previous step sampled before
    the scheduler has seen it, and if the scheduler appends an output at the wrong
    position (vLLM's leftover placeholder) the model still saw the right one.
    Sampling is a pure function of the position, so no record is needed.
    """

    def tokens(request_id: str, start: int, end: int) -> list[int]:
        n = prompt_length(request_id)
        head = prompt(request_id, start, min(end, n)) if start < n else []
        if end <= n:
            return head
        seed = request_seed(request_id)
        return head + [sample_token(seed, pos, eos_probability)
                       for pos in range(max(start, n), end)]

    return tokens


def sample_step(out: SchedulerOutput, result: ModelRunnerOutput, seeds: dict[str, int],
                eos_probability: float) -> None:
    """Sample the next token of every request whose scheduled tokens reach its end.

    Every model runner samples through here, so runs with either runner agree
    token for token. ``seeds`` caches each request's seed between steps.
    """
    for sched in out.scheduled:
        end = sched.num_computed_tokens + sched.num_scheduled_tokens
        if end < sched.num_tokens:
            continue  # a prefill chunk that does not reach the end samples nothing
        seed = seeds.get(sched.request_id)
        if seed is None:
            seed = seeds[sched.request_id] = request_seed(sched.request_id)
        result.sampled_token_ids[sched.request_id] = [
            sample_token(seed, end, eos_probability)]


class InvalidWindow:
    """Blocks reported invalid by the steps the scheduler had not processed yet.

    Under an async batch queue a step is scheduled before the previous one's
    output, so a block that step reported invalid may still be read now; the
    recovery path must discard what read it, exactly as for this step's own
    failures. ``window(out, invalid)`` is this step's invalid blocks plus those
    of the ``out.in_flight_steps`` steps before it.
    """

    def __init__(self) -> None:
        self._recent: deque[set[int]] = deque(maxlen=8)

    def window(self, out: SchedulerOutput, invalid: set[int]) -> set[int]:
        recent = list(self._recent)[len(self._recent) - out.in_flight_steps:] \
            if out.in_flight_steps else []
        self._recent.append(set(invalid))
        if not any(recent):
            return invalid
        return set(invalid).union(*recent)


def discarded_requests(out: SchedulerOutput, invalid: set[int]) -> set[str]:
    """Scheduled requests that read a block reported invalid in this step.

    The recovery path throws their output away, and the KV they computed was
    computed over bad KV, so nothing of theirs may be saved to the store: not just
    the owner of the failed load, but every request sharing the failed block.
    Blocks a step allocates are never the target of its loads, so checking the
    whole table is the same as checking the blocks read.
    """
    if not invalid:
        return set()
    return {s.request_id for s in out.scheduled if not invalid.isdisjoint(s.block_ids)}


class SimulatedExecutor:
    def __init__(self, faults: FaultPlan | None = None, store: ExternalStoreIndex | None = None,
                 eos_probability: float = 0.0, async_delay_steps: int = 1) -> None:
        self.store = store
        self.eos_probability = eos_probability
        self.transfers = (TransferTracker(faults or FaultPlan(), store, async_delay_steps)
                          if store is not None else None)
        self._seeds: dict[str, int] = {}
        self._invalid = InvalidWindow()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        if self.transfers is not None:
            for outcome in self.transfers.start(out.step, out.loads):
                result.invalid_block_ids.update(outcome.failed)
            for outcome in self.transfers.finish_due(out.step):
                result.invalid_block_ids.update(outcome.failed)
                result.finished_recving.add(outcome.spec.request_id)
        invalid = self._invalid.window(out, result.invalid_block_ids)
        if self.store is not None:
            discarded = discarded_requests(out, invalid)
            for save in out.saves:
                if save.request_id not in discarded:
                    self.store.insert(save.block_hash)
        sample_step(out, result, self._seeds, self.eos_probability)
        for rid in out.finished_req_ids:
            self._seeds.pop(rid, None)
        return result

    @property
    def has_pending_work(self) -> bool:
        return self.transfers is not None and self.transfers.has_in_flight
