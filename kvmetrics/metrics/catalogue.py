"""The one catalogue of every series kvmetrics exports.

Exporters, dashboards, alert rules, docs and tests read this module; nothing else
spells a metric name. Renaming a series here is a breaking change for every
dashboard and alert that users have imported, so it must be recorded in
docs/metrics.md and the changelog.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Literal

MetricKind = Literal["counter", "gauge", "histogram", "info"]

PREFIX = "kvmetrics_"

#: Labels carried by every series, so that several models and data-parallel
#: engines can share one Prometheus without colliding.
COMMON_LABELS: tuple[str, ...] = ("model_name", "engine")


@dataclass(frozen=True)
class MetricSpec:
    """Static description of one exported metric family.

    ``name`` is the name as it appears on the scrape page for the sample a user
    queries: counters carry their ``_total`` suffix here, because forgetting it
    is exactly how a shipped alert ends up querying a series that never exists.
    """

    name: str
    kind: MetricKind
    help: str
    unit: str = ""
    #: Extra labels beyond :data:`COMMON_LABELS`, with every allowed value. A
    #: bounded value set is what keeps cardinality under control: request ids
    #: can never become label values.
    labels: dict[str, tuple[str, ...]] = field(default_factory=dict)
    buckets: tuple[float, ...] = ()
    #: Labels whose values are not enumerable up front (the version string of the
    #: build info); bounded by construction instead.
    open_labels: tuple[str, ...] = ()

    @property
    def label_names(self) -> tuple[str, ...]:
        return COMMON_LABELS + tuple(self.labels) + self.open_labels

    @property
    def base_name(self) -> str:
        """Name without the ``_total`` suffix (what prometheus-client wants)."""
        if self.kind == "counter" and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        if self.kind == "info" and self.name.endswith("_info"):
            return self.name[: -len("_info")]
        return self.name

    def series_names(self) -> tuple[str, ...]:
        """Every sample name this family exposes on a scrape page."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


SOURCE = ("local", "external")
ADMISSION = ("first", "repeat")
MODE = ("sync", "async")
POLICY = ("recompute", "fail")
FINISH_REASONS = ("stopped", "length", "aborted", "error")
REQUEST_STATES = ("running", "waiting", "waiting_for_remote_kv")
#: Why the guard refused an increment.
REJECTION_REASONS = ("negative", "non_finite", "not_a_number", "overflow", "bad_labels")
#: The cross-metric and pool invariants of kvmetrics.metrics.invariants, by name.
INVARIANTS = (
    "hits_within_queries",        # prefix hits <= queries, per source (cumulative)
    "pool_blocks_balance",        # free + used blocks == usable blocks
    "ref_counts_non_negative",    # no block reference count below zero
    "rollback_within_computed",   # 0 <= a rollback's new count <= its count before
    "recompute_within_rollback",  # recomputed after failures <= rolled back + discarded
    "counters_monotonic",         # every exported counter series is non-decreasing
)
#: The vLLM methods the instrumented scheduler hooks and the vLLM state it reads (the
#: tables in kvmetrics/vllm/hooks.py; a test keeps them equal).
HOOKS = (
    "scheduler.schedule", "scheduler.update_from_output", "scheduler._preempt_request",
    "scheduler._free_request", "scheduler._handle_invalid_blocks",
    "scheduler._update_requests_with_invalid_blocks", "scheduler._handle_failed_recving",
    "kv_cache_manager.record_prefix_cache_stats", "kv_cache_manager.evict_blocks",
    "kv_cache_manager.reset_prefix_cache", "block_pool._maybe_evict_cached_block",
    "connector.update_state_after_alloc",
    # vLLM state the hooks read (kvmetrics/vllm/hooks.py ATTRIBUTES).
    "scheduler.requests", "scheduler.running", "scheduler.waiting",
    "scheduler.kv_holding_waiting", "scheduler.recompute_kv_load_failures",
    "kv_cache_manager.usage", "block_pool.num_gpu_blocks", "block_pool.blocks",
    "kv_connector_output.invalid_block_ids", "kv_connector_output.finished_recving",
)

#: The instrumented scheduler's comparisons of a figure it derives from vLLM's internals
#: with the one vLLM computes itself (kvmetrics/vllm/selfcheck.py).
SELF_CHECKS = (
    "requests_running",                # len(running) vs vLLM's get_request_counts()
    "requests_waiting",                # kvmetrics' walk of vLLM's waiting queues vs vLLM's
    "requests_waiting_for_remote_kv",  # requests awaiting remote KV <= vLLM's waiting count
    "requests_finished",               # requests vLLM freed whose finish kvmetrics counted
    "kv_load_failed_requests",         # failed-load requests vs vLLM's recovery log line
    "preemptions",                     # a finished request's preemptions vs vLLM's own count
    "prompt_tokens",                   # an admission's prompt tokens by source vs vLLM's split
    "vllm_kv_load_stats",              # KV-load failure figures vs vLLM's own, where it has them
)

#: Microseconds to seconds: the recovery path is a few dict look-ups when one
#: block fails and a cache-wide scan when thousands do.
RECOVERY_BUCKETS: tuple[float, ...] = (
    1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0,
)

PREFIX_CACHE_QUERY_TOKENS = MetricSpec(
    "kvmetrics_prefix_cache_query_tokens_total", "counter",
    "Prompt tokens looked up in the local prefix cache (source=local) or offered to "
    "the KV connector (source=external), counted once per admission; admission=repeat "
    "marks a re-admission after preemption or after a failed load was reset.",
    unit="tokens", labels={"source": SOURCE, "admission": ADMISSION},
)
PREFIX_CACHE_HIT_TOKENS = MetricSpec(
    "kvmetrics_prefix_cache_hit_tokens_total", "counter",
    "Of the queried prompt tokens, those found in the local prefix cache or matched "
    "by the KV connector (external hits are counted even if the load later fails).",
    unit="tokens", labels={"source": SOURCE, "admission": ADMISSION},
)
PROMPT_TOKENS = MetricSpec(
    "kvmetrics_prompt_tokens_total", "counter",
    "Prompt tokens of a request's first scheduled prefill, by where their KV came "
    "from: computed, local prefix cache, or loaded through the KV connector.",
    unit="tokens", labels={"source": ("compute", "local_cache", "external")},
)
KV_LOAD_BLOCKS = MetricSpec(
    "kvmetrics_kv_load_blocks_total", "counter",
    "External KV blocks whose load finished, by load mode and outcome.",
    unit="blocks", labels={"mode": MODE, "outcome": ("ok", "failed")},
)
KV_LOAD_FAILED_REQUESTS = MetricSpec(
    "kvmetrics_kv_load_failed_requests_total", "counter",
    "Requests hit by a failed KV load, and what the failure policy did with them.",
    unit="requests",
    labels={"mode": MODE, "policy": POLICY, "action": ("rescheduled", "failed")},
)
ROLLED_BACK_TOKENS = MetricSpec(
    "kvmetrics_rolled_back_tokens_total", "counter",
    "Computed tokens taken back by the KV-load recovery path (computed count before "
    "the failed step minus the count it was truncated to).",
    unit="tokens", labels={"mode": MODE, "policy": POLICY},
)
RECOMPUTED_TOKENS = MetricSpec(
    "kvmetrics_recomputed_tokens_total", "counter",
    "Tokens scheduled for computation whose KV had already been computed or loaded "
    "before, by the cause that threw it away.",
    unit="tokens", labels={"cause": ("kv_load_failure", "preemption")},
)
EVICTED_BLOCKS = MetricSpec(
    "kvmetrics_evicted_blocks_total", "counter",
    "Blocks removed from the prefix cache, by cause: reuse of a free block "
    "(capacity), a failed KV load (kv_load_failure), or a cache reset.",
    unit="blocks", labels={"cause": ("capacity", "kv_load_failure", "reset")},
)
PREEMPTIONS = MetricSpec(
    "kvmetrics_preemptions_total", "counter",
    "Preemptions: a running request lost its KV blocks because the cache ran out of "
    "free blocks (events; a request preempted twice counts twice).",
    unit="preemptions",
)
FINISHED_REQUESTS = MetricSpec(
    "kvmetrics_finished_requests_total", "counter",
    "Requests that finished, by reason (error includes requests failed by the "
    "kv_load_failure_policy=fail path).",
    unit="requests", labels={"reason": FINISH_REASONS},
)
KV_VERIFIED_TOKENS = MetricSpec(
    "kvmetrics_kv_verified_tokens_total", "counter",
    "Tokens of KV that the data-plane verifier compared with a clean computation "
    "before a request read them.",
    unit="tokens",
)
KV_VERIFICATION_FAILED_BLOCKS = MetricSpec(
    "kvmetrics_kv_verification_failed_blocks_total", "counter",
    "KV blocks whose content differed from a clean computation when a request read "
    "them and kept its output (stale or poisoned KV; one block read by two requests "
    "counts twice).",
    unit="blocks",
)
KV_CACHE_USAGE = MetricSpec(
    "kvmetrics_kv_cache_usage_ratio", "gauge",
    "Share of KV cache blocks in use by requests, 0..1.",
    unit="ratio",
)
KV_CACHE_BLOCKS = MetricSpec(
    "kvmetrics_kv_cache_blocks", "gauge",
    "KV cache blocks the engine can allocate (the size of its cache, in blocks).",
    unit="blocks",
)
REQUESTS = MetricSpec(
    "kvmetrics_requests", "gauge",
    "Requests in the scheduler by state.",
    unit="requests", labels={"state": REQUEST_STATES},
)
RECOVERY_DURATION = MetricSpec(
    "kvmetrics_recovery_duration_seconds", "histogram",
    "Wall time spent in the KV-load recovery path, per scheduler step that ran it.",
    unit="seconds", buckets=RECOVERY_BUCKETS,
)
INSTRUMENTATION_ERRORS = MetricSpec(
    "kvmetrics_instrumentation_errors_total", "counter",
    "vLLM hooks of the instrumented scheduler that are unusable (missing or with a changed "
    "signature in this vLLM version: counted once at start, and the counters that need "
    "the hook stop) or that raised while running. vLLM itself is never affected.",
    unit="errors", labels={"hook": HOOKS},
)
INSTRUMENTATION_CPU = MetricSpec(
    "kvmetrics_instrumentation_cpu_seconds_total", "counter",
    "CPU time of the instrumented scheduler's own metrics work, an estimate: thread CPU "
    "time around the rare hooks and every recorded step (exporters included), the quiet "
    "step's inline code timed in place on 1 step in 64 and charged to every step, the "
    "eviction wrapper at a calibrated cost per call. It leaves out what kvmetrics costs "
    "inside vLLM's own code (a lower bound). rate() of it is the share of one core.",
    unit="seconds",
)
SELF_CHECK_FAILURES = MetricSpec(
    "kvmetrics_self_check_failures_total", "counter",
    "Self-checks of the instrumented scheduler that found a figure kvmetrics derives "
    "from vLLM's internals different from the one vLLM computes itself, by check, "
    "counted each time one is run and fails (every recorded step, and at each admission, "
    "finish and recovery call it checks). Any increase means "
    "this vLLM's internals moved under kvmetrics: its derived numbers are suspect.",
    unit="failures", labels={"check": SELF_CHECKS},
)
BUILD_INFO = MetricSpec(
    "kvmetrics_build_info", "info",
    "kvmetrics version, the kind of engine it instruments, and its KV-load recovery: "
    "vllm (vLLM's own) or evict (kvmetrics' protective fix); on vLLM, the running vLLM "
    "version, whether kvmetrics was verified on it (true: the version is listed and the "
    "source of every vLLM function it depends on matches its fingerprint) and the ones "
    "that differ (empty elsewhere). Value is always 1.",
    open_labels=("version", "engine_kind", "recovery", "vllm_version", "vllm_verified",
                 "vllm_fingerprints_differ"),
)

#: Counters whose increments are events an engine reports, each passing the guard.
EVENT_COUNTERS: tuple[MetricSpec, ...] = (
    PREFIX_CACHE_QUERY_TOKENS,
    PREFIX_CACHE_HIT_TOKENS,
    PROMPT_TOKENS,
    KV_LOAD_BLOCKS,
    KV_LOAD_FAILED_REQUESTS,
    ROLLED_BACK_TOKENS,
    RECOMPUTED_TOKENS,
    EVICTED_BLOCKS,
    PREEMPTIONS,
    FINISHED_REQUESTS,
    KV_VERIFIED_TOKENS,
    KV_VERIFICATION_FAILED_BLOCKS,
    INSTRUMENTATION_ERRORS,
    INSTRUMENTATION_CPU,
    SELF_CHECK_FAILURES,
)

GUARD_REJECTED_INCREMENTS = MetricSpec(
    "kvmetrics_guard_rejected_increments_total", "counter",
    "Counter increments the guard refused to pass to the client libraries, by the "
    "counter they were meant for and why (a negative, non-finite or non-numeric amount, "
    "a total that would overflow, or label values outside the catalogue). Any "
    "increase is a bug in the engine's accounting; the engine keeps running.",
    unit="increments",
    labels={"metric": tuple(s.name for s in EVENT_COUNTERS), "reason": REJECTION_REASONS},
)
INVARIANT_VIOLATIONS = MetricSpec(
    "kvmetrics_invariant_violations_total", "counter",
    "Breaks of a cross-metric or block-pool invariant found after a scheduler step, "
    "by invariant (see docs/metrics.md). Any increase is a bug in the engine or in "
    "its instrumentation.",
    unit="violations", labels={"invariant": INVARIANTS},
)

#: Why a multiprocess file was left out of a page, or rewritten by its writer.
SCRAPE_ERROR_REASONS = ("unreadable_multiprocess_file", "multiprocess_file_over_budget",
                        "multiprocess_file_rewritten", "multiprocess_file_unwritable",
                        "multiprocess_rewrite_failed", "multiprocess_series_unstored")

SCRAPE_ERRORS = MetricSpec(
    "kvmetrics_scrape_errors_total", "counter",
    "Problems with the multiprocess files (PROMETHEUS_MULTIPROC_DIR) that did not stop "
    "the page or the engine, by reason: unreadable_multiprocess_file is a *.db file that "
    "could not be read (empty, truncated) and was left out of a page; "
    "multiprocess_file_over_budget is one left out because reading it would pass the "
    "scrape's budget of series, bytes or time; multiprocess_file_rewritten is a repair "
    "of this process's own files (one truncated, replaced, deleted or overwritten, or "
    "the directory deleted and made again), written anew from the values in memory; "
    "multiprocess_file_unwritable is one rewritten because every write to it failed; "
    "multiprocess_rewrite_failed is a repair that failed (retried once a second); "
    "multiprocess_series_unstored is a new series its file had no room for (or that "
    "could not be opened), kept in memory only until a rewrite gives it a place.",
    unit="errors", labels={"reason": SCRAPE_ERROR_REASONS},
)

#: The families an engine computes from what it sees (not the exporter's own bookkeeping):
#: each can be live or, where a vLLM hook they need is unusable, absent from the page.
COMPUTED_FAMILIES: tuple[MetricSpec, ...] = (
    *EVENT_COUNTERS,
    GUARD_REJECTED_INCREMENTS,
    INVARIANT_VIOLATIONS,
    KV_CACHE_USAGE,
    KV_CACHE_BLOCKS,
    REQUESTS,
    RECOVERY_DURATION,
)
#: Families only the lab's data plane computes (its KV verifier): an instrumented vLLM
#: never does, so they are not expected there and alerts on them are ``scope: lab``.
LAB_ONLY_FAMILIES: tuple[MetricSpec, ...] = (KV_VERIFIED_TOKENS, KV_VERIFICATION_FAILED_BLOCKS)
FAMILY_LIVE = MetricSpec(
    "kvmetrics_family_live", "gauge",
    "Per family this engine is meant to compute: 1 while it computes it, 0 while it "
    "cannot (a vLLM hook it needs is missing, changed or failed; the family is then "
    "absent from the page, and alerts built on it cannot fire). Families the engine never "
    "computes (the lab's verifier on vLLM) have no series. Set at start and whenever a "
    "family goes absent.",
    labels={"family": tuple(s.name for s in COMPUTED_FAMILIES)},
)


def expected_families(engine_kind: str) -> tuple[str, ...]:
    """The families an engine of this kind computes when every hook works."""
    lab_only = {s.name for s in LAB_ONLY_FAMILIES} if engine_kind == "vllm" else set()
    return tuple(s.name for s in COMPUTED_FAMILIES if s.name not in lab_only)


#: Every family but the overflow counter: the exporter caps their series and counts the
#: updates it drops in the overflow counter.
_CAPPED_FAMILIES: tuple[MetricSpec, ...] = (
    *COMPUTED_FAMILIES,
    BUILD_INFO,
    SCRAPE_ERRORS,
    FAMILY_LIVE,
)
SERIES_OVERFLOW = MetricSpec(
    "kvmetrics_series_overflow_total", "counter",
    "Metric updates the exporter dropped because they would have created a series "
    "beyond its family's cap on label sets, or with a label value outside the catalogue "
    "(a runaway label), by the family they were meant for. Existing series keep counting.",
    unit="updates",
    labels={"metric": tuple(s.name for s in _CAPPED_FAMILIES)},
)

ALL_METRICS: tuple[MetricSpec, ...] = (*_CAPPED_FAMILIES, SERIES_OVERFLOW)

BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in ALL_METRICS}
COUNTERS: tuple[MetricSpec, ...] = tuple(s for s in ALL_METRICS if s.kind == "counter")


def bounded_label_sets(spec: MetricSpec) -> list[tuple[str, ...]]:
    """Every value combination of a family's own labels, when they are all enumerable.

    Exporters create these series at zero up front, so that ``rate()`` and
    ``increase()`` see a counter's very first increment and an alert needs no
    special case for a series that is born already above zero. Every counter's
    labels are enumerable; only the build info has open labels.
    """
    if spec.open_labels:
        return []
    return [tuple(combo) for combo in itertools.product(*spec.labels.values())]


def exported_series_names() -> frozenset[str]:
    """Every sample name that may appear on the scrape page (for rule/dashboard checks)."""
    names: set[str] = set()
    for spec in ALL_METRICS:
        names.update(spec.series_names())
    return frozenset(names)


def spec(name: str) -> MetricSpec:
    """Look a metric up by its exported name; unknown names are a programming error."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name!r} is not in the kvmetrics catalogue") from None


#: vLLM's own series (served by vLLM's API server, not by kvmetrics) that the
#: dashboards show beside kvmetrics' for the operator's cross-check. kvmetrics never
#: exports them; they are here so that dashboards and their checks spell them from
#: one table too. Names and labels as vLLM 0.32 serves them on ``/metrics``
#: (``model_name`` and ``engine``, like kvmetrics'); the NIXL ones exist only where
#: a NixlConnector is configured.
VLLM_SERIES: tuple[MetricSpec, ...] = (
    MetricSpec("vllm:external_prefix_cache_hits_total", "counter",
               "vLLM: prompt tokens found through the KV connector (all admissions)."),
    MetricSpec("vllm:external_prefix_cache_queries_total", "counter",
               "vLLM: prompt tokens looked up through the KV connector."),
    MetricSpec("vllm:nixl_num_failed_transfers_total", "counter",
               "vLLM (NIXL): KV transfers that failed."),
    MetricSpec("vllm:nixl_num_kv_expired_reqs_total", "counter",
               "vLLM (NIXL, prefill side): requests whose KV lease expired unclaimed."),
)
