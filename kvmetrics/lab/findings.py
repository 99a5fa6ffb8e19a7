"""Findings explained: what the verifier and the metrics guard found, and why.

The verifier reports *that* a request read bad KV; the data plane's provenance
(:mod:`kvmetrics.lab.kv.provenance`) says which event made that KV bad and what
happened to its owner afterwards. This module turns the two into what a person
acts on: how many reads, requests and blocks, from which step, the cause when
it is one of the known ones (with the docs section and the option that avoids
it), and the facts when it is not. Guard rejections and invariant violations
are grouped the same way, naming the metric, the first step and the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmetrics.lab.config import LabConfig
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.totals import Totals

DOCS_STALE = "docs/vllm-defects.md#recompute-keeps-failed-block"
DOCS_SHARERS = "docs/vllm-defects.md#fail-sharer-blocks-hashed"
#: Examples kept per group of violations; the counts are always exact.
EXAMPLES_PER_GROUP = 3


@dataclass(frozen=True)
class Cause:
    key: str
    known: bool
    text: str
    docs: str | None = None
    avoid: str | None = None


STALE_FAILED_BLOCK = Cause(
    "stale_failed_block", True,
    "vLLM's recovery path left a failed block (or the blocks its owner computed over it in "
    "the same step) hashed in the prefix cache: the owner was preempted or aborted before "
    "recomputing it, and a later prefix-cache hit read it",
    DOCS_STALE, "--recovery evict")
SHARER_BLOCKS = Cause(
    "sharer_blocks_hashed", True,
    "a request that read a failed block in the step it failed (a same-step sharer) kept "
    "its own new blocks, computed over the poisoned KV, hashed in the prefix cache "
    "(under policy fail only the owner's blocks are evicted)",
    DOCS_SHARERS, "--recovery evict")
DOCS_BEFORE_RECOMPUTE = "docs/vllm-defects.md#chunked-recompute-sharer"
READ_BEFORE_RECOMPUTE = Cause(
    "read_before_recompute", True,
    "a failed block (or a block computed over it in the step it failed) was read while "
    "the request that must recompute it, still running, had not done so yet (a chunked "
    "recompute, or a full step): the block stayed hashed under recompute, or the reader "
    "shared it and kept counting it, and what it computed over it, as valid",
    DOCS_BEFORE_RECOMPUTE, "--recovery evict")
POISONED_SAVE = Cause(
    "poisoned_save", True,
    "KV computed over a failed block was saved to the external store and loaded back "
    "later", "kvmetrics/lab/kv/runner.py (SAVE_POLICIES)", "the discard-aware save rule")
UNKNOWN = Cause("unknown", False, "unknown: the data plane did not poison this block "
                "itself (not a failed load, nor a read of one), or its owner neither left "
                "nor was preempted before the read")


@dataclass
class _Group:
    cause: Cause
    failed_blocks: int = 0
    requests: set[str] = field(default_factory=set)
    blocks: set[int] = field(default_factory=set)
    first_step: int | None = None
    example: str = ""


def _fate_text(fates: Sequence[Any], owner: str, aborted: dict[str, int]) -> str:
    parts = []
    for fate in fates:
        if fate.what == "preempted":
            parts.append(f"preempted at step {fate.step}")
        elif owner in aborted:
            parts.append(f"aborted at step {aborted[owner]}")
        else:
            parts.append(f"finished at step {fate.step}")
    return ", then ".join(parts)


def classify(attribution: Any, policy: str, reader: str | None = None) -> Cause:
    taint = attribution.taint
    if taint is None:
        return UNKNOWN
    left = any(f.what in ("preempted", "finished") for f in attribution.owner_fates)
    if taint.kind == "from_store":
        return POISONED_SAVE
    own_tail = taint.kind == "discarded_read" and taint.root.request_id == taint.request_id
    if (taint.kind == "failed_load" or own_tail) and left:
        return STALE_FAILED_BLOCK
    if taint.kind == "discarded_read" and not own_tail and (policy == "fail" or left):
        return SHARER_BLOCKS
    # Read by someone else, or by a sharer over whose own blocks it was computed.
    other = reader not in (None, taint.request_id)
    if not left and (taint.kind == "failed_load" and other
                     or taint.kind == "discarded_read" and (other or not own_tail)):
        return READ_BEFORE_RECOMPUTE
    return UNKNOWN


def _describe(finding: Any, attribution: Any, aborted: dict[str, int]) -> str:
    read = (f"step {finding.step}: request {finding.request_id} read bad KV in block "
            f"{finding.block_id} (#{finding.block_index} of its table)")
    taint = attribution.taint
    if taint is None:
        return read + "; the data plane never poisoned that block"
    if taint.kind == "failed_load":
        origin = f"the block's load failed at step {taint.step} for request {taint.request_id}"
    elif taint.kind == "discarded_read":
        root = taint.root
        whose = ("its own block" if root.request_id == taint.request_id
                 else f"a block of request {root.request_id}")
        origin = (f"request {taint.request_id} computed it at step {taint.step} over {whose} "
                  f"whose load failed in that step")
    else:
        origin = (f"request {taint.request_id} loaded it from the external store at step "
                  f"{taint.step}, where KV computed over a failed block had been saved")
    fate = _fate_text(attribution.owner_fates, taint.request_id, aborted)
    if fate:
        origin += f"; {taint.request_id} was {fate}" + (
            " before recomputing it" if taint.kind != "from_store" else "")
    return f"{read}; {origin}"


def explain_findings(cfg: LabConfig, findings: Sequence[Any], attributions: Sequence[Any],
                     aborted: dict[str, int]) -> dict[str, Any]:
    groups: dict[str, _Group] = {}
    for i, finding in enumerate(findings):
        attribution = attributions[i] if i < len(attributions) else None
        cause = (classify(attribution, cfg.policy, finding.request_id)
                 if attribution is not None else UNKNOWN)
        group = groups.setdefault(cause.key, _Group(cause))
        group.failed_blocks += 1
        group.requests.add(finding.request_id)
        group.blocks.add(finding.block_id)
        if group.first_step is None or finding.step < group.first_step:
            group.first_step = finding.step
            group.example = (_describe(finding, attribution, aborted) if attribution
                             is not None else str(finding))
    causes = []
    for group in sorted(groups.values(), key=lambda g: -g.failed_blocks):
        c = group.cause
        avoid = c.avoid
        if avoid == "--recovery evict" and cfg.engine != "reference":
            avoid = "--recovery evict (in a deployment: KVMETRICS_RECOVERY=evict)"
        causes.append({"cause": c.key, "known": c.known, "explanation": c.text,
                       "failed_blocks": group.failed_blocks, "requests": len(group.requests),
                       "blocks": len(group.blocks), "first_step": group.first_step,
                       "example": group.example, "docs": c.docs, "avoid": avoid})
    return {
        #: Equals the summary's verification.failed_blocks: one per block per read.
        "failed_blocks": len(findings),
        "requests": len({f.request_id for f in findings}),
        "blocks": len({f.block_id for f in findings}),
        "first_step": min((f.step for f in findings), default=None),
        "causes": causes,
    }


def explain_violations(violations: Sequence[Any], totals: Totals) -> list[dict[str, Any]]:
    """Guard rejections by (metric, reason) and invariant violations by invariant, first
    one first. Counts come from the totals (exact); the first step, request and examples
    from the violations the pipeline kept (the first ones of a run)."""
    groups: dict[tuple[str, ...], dict[str, Any]] = {}
    for v in violations:
        if v.is_rejection:
            key: tuple[str, ...] = ("guard_rejection", v.metric, v.kind)
            head = {"kind": "guard_rejection", "metric": v.metric, "reason": v.kind}
        else:
            key = ("invariant", str(v.invariant))
            head = {"kind": "invariant", "invariant": v.invariant, "metric": v.metric}
        g = groups.get(key)
        if g is None:
            g = groups[key] = {**head, "count": 0, "first_step": v.step,
                               "first_request": v.request_id, "examples": []}
        if g["first_request"] is None and v.request_id:
            g["first_request"] = v.request_id
        if len(g["examples"]) < EXAMPLES_PER_GROUP:
            g["examples"].append(v.describe())
    for key, g in groups.items():
        if key[0] == "guard_rejection":
            g["count"] = int(totals.get(cat.GUARD_REJECTED_INCREMENTS, metric=key[1],
                                        reason=key[2]))
        else:
            g["count"] = int(totals.get(cat.INVARIANT_VIOLATIONS, invariant=key[1]))
    return sorted(groups.values(), key=lambda g: (g["first_step"], g["kind"], g["metric"]))
