"""Workload items: what arrives when, independent of any engine."""

from __future__ import annotations

from dataclasses import dataclass

from kvmetrics.lab.engine.tokens import PromptTokens


@dataclass(frozen=True, slots=True)
class WorkItem:
    request_id: str
    #: Seconds since the start of the workload.
    arrival_s: float
    prompt: PromptTokens
    max_tokens: int
    #: Whether the request stops early when the sampler emits end-of-sequence.
    stop_on_eos: bool = True
