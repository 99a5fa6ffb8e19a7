"""The "KV cache recovery" dashboard: what the KV-load recovery path did, and its cost.

Layout follows the questions an operator asks during an incident: is the cache
still paying off (prefix hit ratios), are KV loads failing and what did recovery
cost (rolled-back and recomputed tokens), is the cache churning (evictions), is
the scheduler under pressure, did anyone read bad KV (verification), and can we
trust the numbers at all (counter violations, exporter health).
"""

from __future__ import annotations

from collections.abc import Callable

from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    Panel,
    VariableModel,
    VariableRefresh,
    VariableSort,
)

from dashboards import panels as p
from dashboards.queries import (
    FILTER,
    quantile,
    ratio,
    sel,
    sum_rate,
    target_sel,
    vllm_sum_rate,
)
from kvmetrics.metrics import catalogue as c

UID = "kvmetrics-kv-recovery"
TITLE = "KV cache recovery"
#: The runbook as a path in this repository; ``deploy/kubernetes/generate.py --runbook-base``
#: makes it a full URL where your on-call browses the repository, as in the alert rules.
RUNBOOK_URL = "docs/runbook.md"

Panels = list[cogbuilder.Builder[Panel]]

_QUERY = c.PREFIX_CACHE_QUERY_TOKENS.name
_HIT = c.PREFIX_CACHE_HIT_TOKENS.name
_PROMPT = c.PROMPT_TOKENS.name
_BLOCKS = c.KV_LOAD_BLOCKS.name
_FAILED_REQ = c.KV_LOAD_FAILED_REQUESTS.name
_ROLLED = c.ROLLED_BACK_TOKENS.name
_RECOMPUTED = c.RECOMPUTED_TOKENS.name
_EVICTED = c.EVICTED_BLOCKS.name
_REJECTED = c.GUARD_REJECTED_INCREMENTS.name
_INVARIANTS = c.INVARIANT_VIOLATIONS.name
#: The labels that tell one replica's series from another's (with data parallelism,
#: one engine of one replica): kept wherever a panel shows a per-engine state.
_REPLICA = ("job", "instance", "model_name", "engine")


def _hit_ratio(source: str) -> str:
    """Hit ratio of first admissions (re-admissions look their own KV up again)."""
    return ratio(sum_rate(_HIT, source=source, admission="first"),
                 sum_rate(_QUERY, source=source, admission="first"))


def _in_range(name: str) -> str:
    """Increments within the dashboard's time range (the series exist from 0 at start)."""
    return f"sum(increase({sel(name)}[$__range]))"


def summary_stats() -> Panels:
    """Top row: six numbers that say whether recovery is happening and what it costs."""
    return [
        p.single_stat(
            "Local prefix hit ratio",
            "Share of prompt tokens looked up in the local prefix cache that were found, at "
            "first admission. No data while nothing is looked up.",
            p.RATIO, _hit_ratio("local"), steps=p.HIGHER_BETTER,
        ),
        p.single_stat(
            "External prefix hit ratio",
            "Share of prompt tokens offered to the KV connector that it matched, at first "
            "admission; counted when matched, even if the load later fails. No data without "
            "a connector.",
            p.RATIO, _hit_ratio("external"), steps=p.HIGHER_BETTER,
        ),
        p.single_stat(
            "Failed KV load blocks",
            "External KV blocks whose load failed, per second (all modes).",
            p.BLOCKS_PER_S, sum_rate(_BLOCKS, outcome="failed"),
            steps=((None, "green"), (1e-9, "yellow"), (1, "red")),
        ),
        p.single_stat(
            "Rolled-back tokens",
            "Computed tokens the recovery path took back, per second.",
            p.TOKENS_PER_S, sum_rate(_ROLLED),
            steps=((None, "green"), (1e-9, "yellow"), (1000, "red")), width=3,
        ),
        p.single_stat(
            "Recompute waste",
            "Tokens computed again (after failed loads or preemption) as a share of prompt "
            "tokens of first prefills. Can exceed 100% when decode tokens are lost too.",
            p.RATIO, ratio(sum_rate(_RECOMPUTED), sum_rate(_PROMPT)),
            steps=((None, "green"), (0.05, "yellow"), (0.2, "red")), width=3,
        ),
        p.single_stat(
            "Guard rejections",
            "Counter increments the guard refused (negative or non-finite) in the selected "
            "time range. Any value above zero is an accounting bug: see the runbook.",
            p.COUNT, _in_range(_REJECTED), steps=p.ANY_IS_BAD, instant=True, width=3,
        ),
        p.single_stat(
            "Invariant violations",
            "Broken cross-metric or block-pool invariants in the selected time range. Any "
            "value above zero means the figures of that engine cannot be trusted.",
            p.COUNT, _in_range(_INVARIANTS), steps=p.ANY_IS_BAD, instant=True, width=3,
        ),
    ]


def prefix_caching() -> Panels:
    by = ("source", "admission")
    return [
        p.time_series(
            "Prefix hit ratio by source and admission",
            "admission=repeat marks re-admissions after preemption or a reset failed load; "
            "vLLM's own stats drop those.",
            p.RATIO,
            [(ratio(sum_rate(_HIT, by=by), sum_rate(_QUERY, by=by)), "{{source}} {{admission}}")],
            steps=p.HIGHER_BETTER, max_value=1, width=8,
        ),
        p.time_series(
            "Prefix lookups",
            "Prompt tokens looked up and found, per second, by source.",
            p.TOKENS_PER_S,
            [
                (sum_rate(_QUERY, by=("source",)), "queried {{source}}"),
                (sum_rate(_HIT, by=("source",)), "hit {{source}}"),
            ],
            width=8,
        ),
        p.time_series(
            "Prompt tokens by KV source",
            "Where the KV of first-prefill prompt tokens came from: computed, local cache "
            "or loaded through the connector.",
            p.TOKENS_PER_S,
            [(sum_rate(_PROMPT, by=("source",)), "{{source}}")],
            stacked=True, width=8,
        ),
    ]


def kv_loads_and_recovery() -> Panels:
    failed_by_mode = sum_rate(_BLOCKS, by=("instance", "mode"), outcome="failed")
    return [
        p.time_series(
            "KV load blocks by mode and outcome",
            "External blocks whose load finished, per second.",
            p.BLOCKS_PER_S,
            [(sum_rate(_BLOCKS, by=("mode", "outcome")), "{{mode}} {{outcome}}")],
            width=8,
        ),
        p.time_series(
            "KV load failure ratio by replica and mode",
            "Failed blocks over all finished external block loads, per replica (the "
            "KVMetricsKVLoadFailureRatioHigh alert judges each replica on its own).",
            p.RATIO,
            [(ratio(failed_by_mode, sum_rate(_BLOCKS, by=("instance", "mode"))),
              "{{instance}} {{mode}}")],
            steps=((None, "green"), (0.01, "yellow"), (0.05, "red")), max_value=1, width=8,
        ),
        p.time_series(
            "Requests hit by failed loads",
            "Requests whose KV load failed, by mode, failure policy and what the policy did "
            "(rescheduled to recompute, or failed with an error).",
            p.REQ_PER_S,
            [
                (
                    sum_rate(_FAILED_REQ, by=("mode", "policy", "action")),
                    "{{mode}} {{policy}} {{action}}",
                )
            ],
            width=8,
        ),
        p.time_series(
            "Rolled-back tokens by mode and policy",
            "Computed tokens taken back by the recovery path, per second.",
            p.TOKENS_PER_S,
            [(sum_rate(_ROLLED, by=("mode", "policy")), "{{mode}} {{policy}}")],
            width=8,
        ),
        p.time_series(
            "Recomputed tokens by cause",
            "Tokens computed again because their KV was lost to a failed load or preemption.",
            p.TOKENS_PER_S,
            [(sum_rate(_RECOMPUTED, by=("cause",)), "{{cause}}")],
            stacked=True, width=8,
        ),
        p.time_series(
            "Recovery path duration",
            "Quantiles of the wall time per scheduler step that ran the recovery path.",
            p.SECONDS,
            [
                (quantile(0.5, c.RECOVERY_DURATION), "p50"),
                (quantile(0.9, c.RECOVERY_DURATION), "p90"),
                (quantile(0.99, c.RECOVERY_DURATION), "p99"),
            ],
            steps=((None, "green"), (0.01, "yellow"), (0.1, "red")), width=8,
        ),
    ]


def vllm_cross_check() -> Panels:
    """vLLM's own connector series, per replica, for the operator's check that vLLM
    and kvmetrics count the same traffic (docs/connectors.md lists the pairs)."""
    hits, queries, nixl_failed, nixl_expired = (s.name for s in c.VLLM_SERIES)
    by = ("replica",)
    return [
        p.time_series(
            "External prefix hits (vLLM's count)",
            "vLLM's API server's count of prompt tokens looked up and found through the KV "
            "connector, per second and replica: equals kvmetrics' external hits of all "
            "admissions (\"Prefix lookups\", hit external). vLLM's endpoint is another "
            "target than kvmetrics', so the Replica filter does not apply; the `replica` "
            "target label (deploy/prometheus/prometheus.yml) names the lines.",
            p.TOKENS_PER_S,
            [
                (vllm_sum_rate(queries, by=by), "queried {{replica}}"),
                (vllm_sum_rate(hits, by=by), "hit {{replica}}"),
            ],
            width=12,
        ),
        p.time_series(
            "NIXL failed transfers and expired leases (vLLM's count)",
            "vLLM's NIXL counters, only where a NixlConnector runs: transfers that failed "
            "(compare with \"Requests hit by failed loads\") and KV leases a prefill "
            "server let expire unclaimed (decode requests that never came).",
            p.REQ_PER_S,
            [
                (vllm_sum_rate(nixl_failed, by=by), "failed transfers {{replica}}"),
                (vllm_sum_rate(nixl_expired, by=by), "expired leases {{replica}}"),
            ],
            width=12,
        ),
    ]


def evictions() -> Panels:
    turnover = ratio(f"{sum_rate(_EVICTED, by=_REPLICA, cause='capacity')} * 300",
                     f"sum by ({', '.join(_REPLICA)}) ({sel(c.KV_CACHE_BLOCKS.name)})")
    return [
        p.time_series(
            "Evicted blocks by cause",
            "Blocks removed from the prefix cache: capacity (free block reused), "
            "kv_load_failure (failed block and its chained successors), reset.",
            p.BLOCKS_PER_S,
            [(sum_rate(_EVICTED, by=("cause",)), "{{cause}}")],
            stacked=True, width=8,
        ),
        p.time_series(
            "Evictions caused by failed loads",
            "Share of evicted blocks that a failed KV load removed.",
            p.RATIO,
            [(ratio(sum_rate(_EVICTED, cause="kv_load_failure"), sum_rate(_EVICTED)), "share")],
            steps=((None, "green"), (0.05, "yellow"), (0.25, "red")), max_value=1, width=8,
        ),
        p.time_series(
            "Cache turnover per 5 minutes",
            "Blocks evicted for capacity in 5 minutes over the cache's size, per engine: "
            "above 1 while the engine preempts is thrashing (KVMetricsEvictionThrashing).",
            p.NONE,
            [(turnover, "{{instance}} engine {{engine}}")],
            steps=((None, "green"), (1, "yellow")), width=8,
        ),
    ]


def scheduler_state() -> Panels:
    usage = f"max by ({', '.join(_REPLICA)}) ({sel(c.KV_CACHE_USAGE.name)})"
    return [
        p.time_series(
            "Requests by state",
            "Requests in the scheduler; waiting_for_remote_kv waits on async KV loads.",
            p.COUNT,
            [(f"sum by (state) ({sel(c.REQUESTS.name)})", "{{state}}")],
            stacked=True, width=8,
        ),
        p.time_series(
            "KV cache usage",
            "Share of KV cache blocks in use by requests, per engine of each replica.",
            p.RATIO,
            [(usage, "{{instance}} {{model_name}} engine {{engine}}")],
            steps=((None, "green"), (0.8, "yellow"), (0.95, "red")), max_value=1, width=8,
        ),
        p.time_series(
            "Preemptions and finished requests",
            "Preemptions (events) and finished requests by reason (error includes requests "
            "failed by kv_load_failure_policy=fail), per second.",
            p.PER_S,
            [
                (sum_rate(c.PREEMPTIONS.name), "preemptions"),
                (sum_rate(c.FINISHED_REQUESTS.name, by=("reason",)), "finished {{reason}}"),
            ],
            width=8,
        ),
    ]


def verification() -> Panels:
    return [
        p.time_series(
            "Verified KV tokens",
            "Tokens of KV the data-plane verifier compared with a clean computation.",
            p.TOKENS_PER_S,
            [(sum_rate(c.KV_VERIFIED_TOKENS.name), "verified")],
        ),
        p.time_series(
            "KV verification failed blocks",
            "KV blocks that differed from a clean computation when a request read them and "
            "kept its output (stale or poisoned KV). Any value is an incident.",
            p.BLOCKS_PER_S,
            [(sum_rate(c.KV_VERIFICATION_FAILED_BLOCKS.name), "failed blocks")],
            steps=p.ANY_IS_BAD,
        ),
    ]


def exporter_health() -> Panels:
    build = sel(c.BUILD_INFO.name)
    return [
        p.single_stat(
            "Targets up",
            "Scrape targets of the jobs that export kvmetrics (1 = up).",
            p.NONE, target_sel("up"), legend="{{job}} {{instance}}",
            steps=((None, "red"), (1, "green")), width=6, height=6,
        ),
        p.single_stat(
            "kvmetrics build",
            "Engines per kvmetrics version, instrumented engine kind and recovery path "
            "(evict: the protective fix changes vLLM's decisions on these replicas).",
            p.COUNT, f"count by (version, engine_kind, recovery) ({build})",
            legend="{{version}} {{engine_kind}} recovery={{recovery}}", steps=p.NEUTRAL,
            width=6, height=6,
        ),
        p.time_series(
            "Scrape duration",
            "Time Prometheus spends scraping each target; near the timeout means lost data.",
            p.SECONDS,
            [(target_sel("scrape_duration_seconds"), "{{job}} {{instance}}")],
            steps=((None, "green"), (1, "yellow"), (5, "red")), width=6,
        ),
        p.time_series(
            "Dropped series updates",
            "Updates the exporter refused because they would create a series beyond its "
            "family's cap or with a label value outside the catalogue. Any value means a "
            "runaway label (e.g. a request id used as engine). Also: multiprocess files "
            "a scrape had to leave out (unreadable).",
            "count:updates/s",
            [(sum_rate(c.SERIES_OVERFLOW.name, by=("metric",)), "{{metric}}"),
             (sum_rate(c.SCRAPE_ERRORS.name, by=("reason",)), "scrape: {{reason}}")],
            steps=p.ANY_IS_BAD, width=6,
        ),
        p.single_stat(
            "vLLM hooks out of action",
            "Instrumented-scheduler hooks that this vLLM version lacks or changed (counted "
            "once at start; the counters that need them stop) or that raised while running. "
            "vLLM itself is unaffected; see the kvmetrics log line naming the hook.",
            p.COUNT, f"sum by (hook) ({sel(c.INSTRUMENTATION_ERRORS.name)})",
            legend="{{hook}}", steps=p.ANY_IS_BAD, width=6, height=6,
        ),
        p.single_stat(
            "vLLM self-check failures",
            "Figures kvmetrics derives from vLLM's internals that differed from vLLM's own "
            "(e.g. its waiting count against get_request_counts()), in the last hour: this "
            "vLLM's internals moved under kvmetrics. Runbook: KVMetricsSelfCheckFailing.",
            p.COUNT, f"sum by (check) (increase({sel(c.SELF_CHECK_FAILURES.name)}[1h]))",
            legend="{{check}}", steps=p.ANY_IS_BAD, width=6, height=6,
        ),
        p.time_series(
            "kvmetrics overhead",
            "CPU time kvmetrics' own metrics work takes on each engine's scheduler thread, "
            "as a share of one core (rate of kvmetrics_instrumentation_cpu_seconds_total, an "
            "estimate). It leaves out what kvmetrics costs inside vLLM's own code (one more "
            "call, caches), so read it as a lower bound: on the benchmark VM the whole added "
            "cost was 1.3-4x it in most runs. "
            "Compare with the EngineCore's CPU from your node or container metrics; "
            "docs/benchmarks.md gives the share of vLLM's scheduler CPU time.",
            p.RATIO,
            [(f"sum by (instance, engine) (rate({sel(c.INSTRUMENTATION_CPU.name)}"
              f"[$__rate_interval]))", "{{instance}} engine {{engine}}")],
            steps=((None, "green"), (0.05, "yellow"), (0.2, "red")), width=6,
        ),
        p.time_series(
            "Samples per scrape",
            "Series exposed per target: a sudden rise means a label's cardinality grew.",
            p.COUNT,
            [(target_sel("scrape_samples_scraped"), "{{job}} {{instance}}")],
            width=6,
        ),
        p.single_stat(
            "Families live",
            "Per kvmetrics family this engine is meant to compute: 1 while it does, 0 while "
            "it cannot (a vLLM hook it needs is out of action, so the family is absent from "
            "the page and the panels and alerts built on it stay empty). The lowest value "
            "over the selected replicas; pick one in Replica to see which. Families the "
            "engine never computes (the lab's verifier on vLLM) are not listed. Runbook: "
            "KVMetricsFamilyAbsent.",
            p.NONE, f"min by (family) ({sel(c.FAMILY_LIVE.name)})", legend="{{family}}",
            steps=((None, "red"), (1, "green")), instant=True, width=24, height=8,
        ),
    ]


ROWS: tuple[tuple[str, Callable[[], Panels]], ...] = (
    ("Prefix caching", prefix_caching),
    ("KV loads and recovery", kv_loads_and_recovery),
    ("vLLM's own connector series", vllm_cross_check),
    ("Evictions", evictions),
    ("Scheduler state", scheduler_state),
    ("Data-plane verification", verification),
    ("Exporter health", exporter_health),
)


def _variables() -> list[cogbuilder.Builder[VariableModel]]:
    build_info = c.BUILD_INFO.name

    def label_values(
        name: str, label: str, query: str, all_value: str | None
    ) -> dash_b.QueryVariable:
        var = (
            dash_b.QueryVariable(name)
            .label(label)
            .query(query)
            .datasource(p.DATASOURCE)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
        )
        return var.all_value(all_value) if all_value is not None else var

    return [
        dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        label_values("model_name", "Model", f"label_values({build_info}, model_name)", ".*"),
        label_values(
            "instance", "Replica",
            f'label_values({build_info}{{model_name=~"$model_name"}}, instance)', ".*",
        ),
        label_values(
            "engine", "Engine",
            f'label_values({build_info}{{model_name=~"$model_name", instance=~"$instance"}}, '
            "engine)", ".*",
        ),
        # No ".*" for "All": it must expand to the listed jobs only, or the health
        # panels would show every target in Prometheus.
        label_values("job", "Job", f"label_values({build_info}{{{FILTER}}}, job)", None),
    ]


def build() -> dash_b.Dashboard:
    """The dashboard builder; rows are expanded so every panel is visible at once."""
    board = (
        dash_b.Dashboard(TITLE)
        .uid(UID)
        .description(
            "KV-cache load failures and recovery in vLLM-style engines, from the "
            "kvmetrics exporter (catalogue: kvmetrics.metrics.catalogue)."
        )
        .tags(["kvmetrics", "kv-cache", "vllm"])
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .link(
            dash_b.DashboardLink("Runbook")
            .type(DashboardLinkType.LINK)
            .url(RUNBOOK_URL)
            .tooltip("docs/runbook.md of the kvmetrics repository: one section per alert")
            .target_blank(True)
        )
        .variables(_variables())
    )
    for panel in summary_stats():
        board = board.with_panel(panel)
    for title, make_panels in ROWS:
        board = board.with_row(p.row(title))
        for panel in make_panels():
            board = board.with_panel(panel)
    return board

