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
from typing import Any

from vllm.v1.request import RequestStatus

from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.events import GaugeReadings, StepEvents
from kvmetrics.vllm.exporting import LOGGER

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


#: vLLM's status of a request whose KV is still arriving.
_REMOTE_KV = RequestStatus.WAITING_FOR_REMOTE_KVS


class SelfChecks:
    """Reads the gauges, and on its cadence compares kvmetrics' figures with vLLM's.

    A vLLM accessor that raises is a fault of the gauges' hook like any other (the
    scheduler counts it in ``kvmetrics_instrumentation_errors_total`` and the step's
    gauges are absent); vLLM calls the same accessor itself every step.
    """

    def __init__(self) -> None:
        self.logged: set[str] = set()

    def gauges(self, scheduler: Any, holding_attr: str, events: StepEvents) -> GaugeReadings:
        """The step's gauges, each read checked against vLLM's own counts.

        One function on purpose: it runs a few times a second, when its code and
        vLLM's objects are no longer in the CPU caches, and each further call would
        cost more than the reads it makes."""
        holding = getattr(scheduler, holding_attr)
        # kvmetrics' own count, from the vLLM queues it knows (the self-check's side).
        ours_running = len(scheduler.running)
        ours_waiting = len(scheduler.waiting) + len(holding)
        for name in EXTRA_WAITING_QUEUES:
            ours_waiting += len(getattr(scheduler, name, ()))
        # Requests whose KV is still arriving: in vLLM's queue of requests holding KV.
        remote = sum(1 for r in holding if r.status == _REMOTE_KV) if holding else 0
        accessor = getattr(scheduler, "get_request_counts", None)
        if accessor is None:  # a vLLM without it: kvmetrics' own count, unchecked
            running, waiting = ours_running, ours_waiting
        else:
            running, waiting = accessor()
            running, waiting = int(running), int(waiting)
            if ours_running != running:
                self.compare(events, "requests_running", ours_running, running)
            if ours_waiting != waiting:
                self.compare(events, "requests_waiting", ours_waiting, waiting)
            if remote > waiting:
                self.compare(events, "requests_waiting_for_remote_kv", remote, waiting)
        # vLLM's own usage figure, or the cache manager's ``usage`` it returns.
        usage = getattr(scheduler, "get_kv_cache_usage", None)
        manager = scheduler.kv_cache_manager
        return GaugeReadings(
            kv_cache_usage=float(usage() if usage is not None else manager.usage),
            running=running,
            waiting=max(0, waiting - remote),
            waiting_for_remote_kv=remote,
            cache_blocks=manager.block_pool.num_gpu_blocks - 1,
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
