"""The torch model runner: real KV blocks, batched loads, injected faults and the verifier.

It plays the model for a scheduler exactly as the tensor-less
:class:`~kvmetrics.lab.engine.executor.SimulatedExecutor` does (same failed blocks,
through the same :class:`~kvmetrics.lab.engine.transfers.TransferTracker`; same
saves; same sampled tokens), so a run gives the same schedule with either
runner, and on top keeps real KV and checks every read of it. One step:

1. **Loads.** This step's sync loads land in the cache as one batched
   store->cache copy (:class:`~kvmetrics.lab.kv.copy.BlockCopier`, index tensors, no
   loop over blocks); the async loads that complete now land as one batched
   ``index_copy_``. Blocks whose load failed are *poisoned* (NaN): never left
   holding stale KV that could pass for valid. An async load reads the store
   when it starts (its data is staged on the device) and writes the cache only
   when it completes, as a real transfer may: the store can evict those slots
   meanwhile, and a scheduler that hands its blocks to someone else before the
   transfer finished gets them overwritten, which the verifier then reports.
2. **Forward (writes).** Ground-truth KV of every scheduled token of every
   request is computed in one batch and written through the block tables,
   for all requests before any read, as each layer of a real forward writes its
   KV before attention reads it.
3. **Verify (reads).** A verified request's read is every token it attends over
   this step, positions ``0..num_computed+num_scheduled-1`` through its own
   block table, compared with the ground truth of its own prefix. Each
   mismatching block is a :class:`~kvmetrics.lab.kv.verify.Finding`; strict mode
   raises :class:`~kvmetrics.lab.kv.verify.KVVerificationError`.
4. **Saves** of newly full blocks to the host store, except for requests whose
   sync load failed in this step (the executor's rule; see :data:`SAVE_POLICIES`).
5. **Sampling**, with the executor's deterministic sampler.

Semantics of a finding: *a request whose output is kept read KV that differs
from a clean computation.* A request that reads a block reported invalid in this
step (its own sync load failed, or it hit a block another request was loading
in the same step) did attend over poisoned KV, but the recovery path must
discard that step's output for it and roll it back below the failed block; that
is the contract the runner reports invalid blocks under. Such a read is counted
as a *discarded read* (``stats.discarded_reads``), not verified and not a
finding. Because its forward really ran over garbage, the KV it wrote in this
step is poisoned too (``taint_discarded``): if the engine wrongly keeps that
step's progress, or lets anyone reuse those blocks, the next read of them is a
finding. Everyone else is verified (all of them in ``full`` mode, a
deterministic share in ``sampled`` mode, nobody in ``off`` mode).

A request only ever reads tokens below ``num_computed + num_scheduled`` of its
own block table, so a block that failed in step ``t`` and that its owner
recomputes later is never a finding by itself; it becomes one only when some
request reads it before the recompute, which is exactly the engine bug class
the verifier exists to catch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmetrics.lab.engine.executor import InvalidWindow, sample_step
from kvmetrics.lab.engine.external_store import ExternalStoreIndex
from kvmetrics.lab.engine.faults import FaultPlan
from kvmetrics.lab.engine.outputs import LoadSpec, ModelRunnerOutput, SchedulerOutput
from kvmetrics.lab.engine.transfers import LoadOutcome, TransferTracker
from kvmetrics.lab.kv.batch import Segment, StepBatch, segments_of
from kvmetrics.lab.kv.cache import KVCache
from kvmetrics.lab.kv.copy import BlockCopier
from kvmetrics.lab.kv.device import resolve_device, resolve_dtype
from kvmetrics.lab.kv.ground_truth import GroundTruth, PrefixDigestCache, TokenSource
from kvmetrics.lab.kv.provenance import Attribution, Provenance
from kvmetrics.lab.kv.store import HostKVStore
from kvmetrics.lab.kv.verify import Finding, KVVerificationError, VerifySelector, findings_from_mask
from kvmetrics.metrics.events import StepEvents

#: Whose newly full blocks a step does not save: ``discard-aware`` (the default and
#: the tensor-less executor's rule: every request that read a block reported invalid
#: in this step, since its KV was computed over poisoned KV), or ``owner-only``
#: (only requests whose own sync load failed: the older rule, kept to reproduce the
#: poisoned-save finding of the sharers).
SAVE_POLICIES = ("discard-aware", "owner-only")


@dataclass
class RunnerStats:
    """Running totals of what the data plane did (the lab and benchmarks print them)."""

    steps: int = 0
    loaded_blocks: int = 0
    poisoned_blocks: int = 0
    saved_blocks: int = 0
    written_tokens: int = 0
    verified_reads: int = 0
    verified_tokens: int = 0
    #: Request-steps not verified because they read a block reported invalid in
    #: that step: their output is the recovery path's to discard.
    discarded_reads: int = 0
    findings: int = 0


class _StagingTracker(TransferTracker):
    """The shared tracker, plus a note of the async loads it starts (to stage their data)."""

    def __init__(self, faults: FaultPlan, store: ExternalStoreIndex,
                 async_delay_steps: int) -> None:
        super().__init__(faults, store, async_delay_steps)
        self.started_async: list[LoadOutcome] = []

    def resolve(self, step: int, spec: LoadSpec) -> LoadOutcome:
        outcome = super().resolve(step, spec)
        if spec.mode != "sync":
            self.started_async.append(outcome)
        return outcome


class TorchModelRunner:
    def __init__(
        self,
        *,
        block_size: int,
        num_gpu_blocks: int,
        tokens: TokenSource,
        store: ExternalStoreIndex | None = None,
        faults: FaultPlan | None = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "float32",
        kv_dim: int = 8,
        verify: str = "full",
        verify_fraction: float = 0.25,
        seed: int = 0,
        strict: bool = False,
        eos_probability: float = 0.0,
        async_delay_steps: int = 1,
        taint_discarded: bool = True,
        save_policy: str = "discard-aware",
    ) -> None:
        if save_policy not in SAVE_POLICIES:
            raise ValueError(f"save_policy must be one of {SAVE_POLICIES}, got {save_policy!r}")
        self.block_size = block_size
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.strict = strict
        self.eos_probability = eos_probability
        self.taint_discarded = taint_discarded
        self.save_policy = save_policy
        self.select = VerifySelector(verify, verify_fraction, seed)
        self.truth = GroundTruth(kv_dim, self.dtype, self.device, seed)
        self.digests = PrefixDigestCache(self.truth, tokens)
        self.cache = KVCache(num_gpu_blocks, block_size, kv_dim, self.dtype, self.device)
        self.copier = BlockCopier(self.device)
        self.store = store
        self.host: HostKVStore | None = None
        self.transfers: _StagingTracker | None = None
        if store is not None:
            self.host = HostKVStore(store, block_size, kv_dim, self.dtype,
                                    pin_memory=self.device.type == "cuda")
            self.transfers = _StagingTracker(faults or FaultPlan(), store, async_delay_steps)
        self.findings: list[Finding] = []
        #: What the data plane knows about each finding's bad KV (same order as findings).
        self.attributions: list[Attribution] = []
        self.provenance = Provenance()
        self.stats = RunnerStats()
        self._seeds: dict[str, int] = {}
        self._invalid = InvalidWindow()
        #: Async loads in flight: outcome id -> (block ids, rows staged on the device).
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def verify_mode(self) -> str:
        return self.select.mode

    @property
    def has_pending_work(self) -> bool:
        return self.transfers is not None and self.transfers.has_in_flight

    def kv_checksum(self) -> str:
        """Digest of the device cache and the host store: equal iff bit-identical."""
        store = self.host.checksum() if self.host is not None else "-"
        return f"{self.cache.checksum()}:{store}"

    # -- one step ------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids:  # first: a finished id may be reused at once
            self.digests.drop(rid)
            self._seeds.pop(rid, None)
        self.provenance.note(out.step, out.preempted_req_ids, out.finished_req_ids)
        result = ModelRunnerOutput()
        bad_requests = self._load(out, result)
        # With a step in flight, blocks it reported invalid count as this step's too.
        invalid = self._invalid.window(out, result.invalid_block_ids)
        segments = segments_of(out, invalid, self.block_size, self.select)
        if self.provenance.active:
            self._trace_writes(segments, invalid, out.step)
        self.stats.discarded_reads += sum(seg.discarded for seg in segments)
        step_findings, verified_tokens = self._forward_and_verify(segments, out.step)
        if self.save_policy == "discard-aware":
            bad_requests.update(seg.request_id for seg in segments if seg.discarded)
        self._save(out, bad_requests)
        self._sample(out, result)

        self.stats.steps += 1
        self.stats.findings += len(step_findings)
        self.findings.extend(step_findings)
        self.attributions.extend(self.provenance.attribute(f.block_id, f.step)
                                 for f in step_findings)
        events = StepEvents(step=out.step)
        events.verified(verified_tokens, len(step_findings))
        result.events = events
        if step_findings and self.strict:
            raise KVVerificationError(step_findings)
        return result

    def _load(self, out: SchedulerOutput, result: ModelRunnerOutput) -> set[str]:
        """Land this step's loads (sync: one batched store->cache copy; async ones due now:
        one ``index_copy_`` of their staged rows), poison every failed block, and return
        the requests whose own sync load failed (the executor's "bad requests")."""
        bad_requests: set[str] = set()
        if self.transfers is None or self.host is None:
            if out.loads:
                raise ValueError("the scheduler issued KV loads but the runner has no store")
            return bad_requests
        pairs: list[tuple[int, int]] = []
        failed: list[int] = []
        for outcome in self.transfers.start(out.step, out.loads):
            result.invalid_block_ids.update(outcome.failed)
            if outcome.failed:
                bad_requests.add(outcome.spec.request_id)
            pairs.extend(outcome.copy)
            failed.extend(outcome.failed)
            self._trace_load(out.step, outcome)
        self._stage_async()
        ids: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        for outcome in self.transfers.finish_due(out.step):
            result.invalid_block_ids.update(outcome.failed)
            result.finished_recving.add(outcome.spec.request_id)
            failed.extend(outcome.failed)
            self._trace_load(out.step, outcome)
            staged = self._staged.pop(id(outcome), None)
            if staged is not None:
                ids.append(staged[0])
                rows.append(staged[1])
        if pairs:
            self.copier.copy(self.cache.data, torch.tensor([b for b, _ in pairs]),
                             self.host.data, torch.tensor([s for _, s in pairs]))
            self.stats.loaded_blocks += len(pairs)
        if ids:
            block_ids = torch.cat(ids)
            self.cache.load_blocks(block_ids, torch.cat(rows))
            self.stats.loaded_blocks += block_ids.numel()
        if failed:
            self.cache.poison_blocks(torch.tensor(failed, dtype=torch.int64))
            self.stats.poisoned_blocks += len(failed)
        return bad_requests

    def _trace_load(self, step: int, outcome: LoadOutcome) -> None:
        """Provenance of the blocks a load lands in (clean, from a tainted slot, failed)."""
        spec = outcome.spec
        prov = self.provenance
        index = {b: spec.first_index + i for i, b in enumerate(spec.block_ids)}
        for block in outcome.failed:
            prov.failed_load(block, step, spec.request_id, index[block])
        if prov.active:
            for block, slot in outcome.copy:
                prov.loaded(block, slot, step, spec.request_id, index[block])

    def _trace_writes(self, segments: list[Segment], invalid: set[int], step: int) -> None:
        """Taint what discarded segments wrote; clear blocks others wholly rewrote."""
        prov = self.provenance
        bs = self.block_size
        for seg in segments:
            if seg.discarded and self.taint_discarded:
                read = next((prov.blocks.get(b) for b in seg.block_ids[:-(-seg.computed // bs)]
                             if b in invalid), None)
                for idx in range(seg.computed // bs, -(-seg.end // bs)):
                    prov.discarded_write(seg.block_ids[idx], step, seg.request_id, idx, read)
            elif prov.blocks:
                for idx in range(-(-seg.computed // bs), seg.end // bs):
                    prov.rewritten(seg.block_ids[idx])

    def _stage_async(self) -> None:
        """Read the store for the async loads started now: one gather for all of them."""
        assert self.transfers is not None and self.host is not None
        started = [o for o in self.transfers.started_async if o.copy]
        self.transfers.started_async.clear()
        if not started:
            return
        slots = torch.tensor([s for o in started for _, s in o.copy], dtype=torch.int64)
        rows = self.copier.gather(self.host.data, slots)
        for outcome, part in zip(started, rows.split([len(o.copy) for o in started]),
                                 strict=True):
            ids = torch.tensor([b for b, _ in outcome.copy], dtype=torch.int64)
            self._staged[id(outcome)] = (ids, part)

    def _forward_and_verify(self, segments: list[Segment],
                            step: int) -> tuple[list[Finding], int]:
        """Write every scheduled token's ground-truth KV, then check the verified reads."""
        if not segments:
            return [], 0
        batch = StepBatch.build(segments, self.digests, self.block_size, self.device,
                                self.taint_discarded)
        kv = self.truth.kv_from_digests(batch.digests)
        values = kv.index_select(0, batch.write_rows)
        if bool(batch.taint.any()):
            values[batch.taint.to(self.device)] = float("nan")
        self.cache.write_tokens(batch.slots.index_select(0, batch.write_rows), values)
        self.stats.written_tokens += batch.write_rows.numel()

        n = batch.verify_rows.numel()
        if not n:
            return [], 0
        read = self.cache.read_tokens(batch.slots.index_select(0, batch.verify_rows))
        ok = (read == kv.index_select(0, batch.verify_rows)).all(dim=1)
        self.stats.verified_reads += len(batch.spans)
        self.stats.verified_tokens += n
        if bool(ok.all()):
            return [], n
        return findings_from_mask(ok.cpu(), batch.spans, self.block_size, step), n

    def _save(self, out: SchedulerOutput, bad_requests: set[str]) -> None:
        """Newly full blocks to the host store; the index picks slots exactly as the executor's."""
        if self.store is None or self.host is None:
            return
        block_of_slot: dict[int, int] = {}
        for save in out.saves:
            if save.request_id in bad_requests:
                continue
            # A slot reused within the step (tiny store) keeps the last block written.
            block_of_slot[self.store.insert(save.block_hash)] = save.block_id
        if not block_of_slot:
            return
        if self.provenance.active:
            for slot, block in block_of_slot.items():
                self.provenance.saved(slot, block)
        slots = torch.tensor(list(block_of_slot), dtype=torch.int64)
        blocks = torch.tensor(list(block_of_slot.values()), dtype=torch.int64)
        self.host.scatter(slots, self.cache.read_blocks(blocks))
        self.stats.saved_blocks += len(block_of_slot)

    def _sample(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """The executor's sampler, token for token: runs with either runner agree."""
        sample_step(out, result, self._seeds, self.eos_probability)
