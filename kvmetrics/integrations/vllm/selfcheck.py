"""Request-count gauges from vLLM's own accessor, and the checks that notice drift.

vLLM says how many requests it has running and waiting (``Scheduler.get_request_counts()``)
and how full its cache is (``Scheduler.get_kv_cache_usage()``): the gauges take those
numbers from vLLM wherever it has them, so a queue vLLM adds (0.34's ``async_kv_waiting``,
behind ``--max-num-inflight-kv-loads``) is counted without kvmetrics knowing about it.
Only the split kvmetrics adds, requests waiting for remote KV, is read from vLLM's
queues: vLLM has no figure of its own for it.

The self-checks compare what kvmetrics derives from vLLM's internals (its own walk of the
queues it knows) with the figure vLLM computes, on every gauge read (every recorded step,
and between those a periodic one; without a pipeline, every step): a handful of
``len()`` calls, so no step is skipped and a request parked a few steps in a queue
kvmetrics does not know is seen. The counter checks run where their events happen, at
O(1) per event:

- an admission: the prompt tokens kvmetrics records by source against the split vLLM
  keeps on the request (``Request.prefill_stats``);
- a finish: the request's preemptions kvmetrics counted against vLLM's own
  ``Request.num_preemptions``;
- a recovery call: the failed-load requests against vLLM's count (:mod:`.recovery_check`);
- the periodic gauge read: requests freed past the finish hook.

A mismatch means a vLLM whose internals moved under kvmetrics (a new release, a fork, a
patch): it is counted in ``kvmetrics_self_check_failures_total{check}`` each time it is
seen, and logged once per check with both values. The checks never change what vLLM does.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any

from vllm.v1.request import RequestStatus

from kvmetrics.integrations.vllm.exporting import LOGGER
from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import GaugeReadings, StepEvents

log = logging.getLogger(LOGGER)

#: Queues of waiting requests kvmetrics knows, by the vLLM attribute names they had;
#: one that a vLLM does not have counts as empty there (``async_kv_waiting`` is 0.34's).
EXTRA_WAITING_QUEUES = ("async_kv_waiting",)
#: Checks of counted events: a failure counts each event found missing.
_EVENT_CHECKS = ("requests_finished", "kv_load_failed_requests", "preemptions")
#: The check of a finished request's preemptions (:meth:`SelfChecks.finished_preemptions`).
PREEMPTIONS_CHECK = "preemptions"
#: The check of an admitted request's prompt tokens by source (:meth:`SelfChecks.prefill`).
PROMPT_TOKENS_CHECK = "prompt_tokens"


@dataclass(frozen=True)
class RequestCounts:
    """Requests running and waiting (all waiting ones, remote KV included), as vLLM counts."""

    running: int
    waiting: int


def derived_request_counts(scheduler: Any, holding_attr: str) -> RequestCounts:
    """kvmetrics' own count, from the vLLM queues it knows (the self-check's side)."""
    waiting = len(scheduler.waiting) + len(getattr(scheduler, holding_attr))
    for name in EXTRA_WAITING_QUEUES:
        waiting += len(getattr(scheduler, name, ()))
    return RequestCounts(len(scheduler.running), waiting)


def vllm_request_counts(scheduler: Any) -> RequestCounts | None:
    """vLLM's own ``get_request_counts()``; None on a vLLM without it."""
    accessor = getattr(scheduler, "get_request_counts", None)
    if accessor is None:
        return None
    running, waiting = accessor()
    return RequestCounts(int(running), int(waiting))


def vllm_kv_cache_usage(scheduler: Any) -> float:
    """vLLM's own ``get_kv_cache_usage()``, or the cache manager's ``usage`` it returns."""
    accessor = getattr(scheduler, "get_kv_cache_usage", None)
    if accessor is not None:
        return float(accessor())
    return float(scheduler.kv_cache_manager.usage)


def remote_kv_waiting(scheduler: Any, holding_attr: str) -> int:
    """Requests whose KV is still arriving (in vLLM's queue of requests holding KV)."""
    status = RequestStatus.WAITING_FOR_REMOTE_KVS
    return sum(1 for r in getattr(scheduler, holding_attr) if r.status == status)


class SelfChecks:
    """Reads the gauges, and on its cadence compares kvmetrics' figures with vLLM's.

    A vLLM accessor that raises is a fault of the gauges' hook like any other (the
    scheduler counts it in ``kvmetrics_instrumentation_errors_total`` and the step's
    gauges are absent); vLLM calls the same accessor itself every step.
    """

    def __init__(self) -> None:
        self.logged: set[str] = set()

    def gauges(self, scheduler: Any, holding_attr: str, events: StepEvents) -> GaugeReadings:
        """The step's gauges, each read checked against vLLM's own counts."""
        ours = derived_request_counts(scheduler, holding_attr)
        theirs = vllm_request_counts(scheduler)
        counts = theirs if theirs is not None else ours
        remote = remote_kv_waiting(scheduler, holding_attr)
        if theirs is not None:
            self.compare(events, "requests_running", ours.running, theirs.running)
            self.compare(events, "requests_waiting", ours.waiting, theirs.waiting)
            if remote > theirs.waiting:
                self.compare(events, "requests_waiting_for_remote_kv", remote, theirs.waiting)
        return GaugeReadings(
            kv_cache_usage=vllm_kv_cache_usage(scheduler),
            running=counts.running,
            waiting=max(0, counts.waiting - remote),
            waiting_for_remote_kv=remote,
            cache_blocks=scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1,
        )

    def unseen_finishes(self, events: StepEvents, tracked: Iterable[str],
                        live: Container[str]) -> list[str]:
        """Requests kvmetrics still tracks that vLLM no longer holds: vLLM freed them
        without kvmetrics seeing the finish (a path past ``_free_request``), so the
        finished counter missed them. Each counts 1 under ``requests_finished``.

        A missed finish stays visible (the request stays tracked until this check
        drops it), so the check finds it at the next periodic gauge read, however the
        steps in between are sampled; it walks the tracked requests, so it runs there
        and not on every step."""
        unseen = [rid for rid in tracked if rid not in live]
        if unseen:
            self.compare(events, "requests_finished", 0, len(unseen))
        return unseen

    def finished_preemptions(self, events: StepEvents, counted: int, request: Any) -> None:
        """A finishing request: the preemptions kvmetrics counted for it against vLLM's
        own ``Request.num_preemptions`` (vLLM adds 1 in ``_preempt_request`` whether or
        not it logs statistics). A preemption vLLM makes past the hook (the work inlined
        in a caller, a new path) shows here when the request finishes; each missing or
        extra preemption counts 1 under ``preemptions``."""
        self.compare(events, PREEMPTIONS_CHECK, counted, int(request.num_preemptions))

    def prefill(self, events: StepEvents, local: int, external: int, request: Any) -> None:
        """An admission whose prompt tokens kvmetrics records (local cache, external;
        the rest is computed): against the split vLLM keeps on the request itself
        (``Request.prefill_stats``, set in the same admission from its own local and
        external counts, whether or not it logs statistics, and taken at the request's
        first output). A request vLLM holds no split for (taken already) is not
        compared. A request whose split differs counts 1 under ``prompt_tokens``."""
        stats = request.prefill_stats
        if stats is None:
            return
        theirs = (int(stats.num_local_cached_tokens), int(stats.num_external_cached_tokens))
        if (local, external) != theirs:
            events.count(cat.SELF_CHECK_FAILURES, 1, PROMPT_TOKENS_CHECK)
            self.log_once(PROMPT_TOKENS_CHECK, (local, external), theirs)

    def compare(self, events: StepEvents, check: str, ours: float, theirs: float) -> None:
        """Count (and log once) a figure of kvmetrics that differs from vLLM's."""
        if ours == theirs:
            return
        # A check of events (not of a state) counts each event it found missing.
        events.count(cat.SELF_CHECK_FAILURES, abs(theirs - ours) if check in _EVENT_CHECKS
                     else 1, check)
        self.log_once(check, ours, theirs)

    def log_once(self, check: str, ours: object, theirs: object) -> None:
        """Log a check's first failure, with both figures."""
        if check not in self.logged:
            self.logged.add(check)
            log.warning("kvmetrics self-check %s failed: kvmetrics derives %s from vLLM's "
                        "internals, vLLM itself says %s; this vLLM differs from the versions "
                        "kvmetrics was verified on (docs/runbook.md)", check, ours, theirs)
