"""What each family kvmetrics counts from vLLM is compared with at run time.

A figure kvmetrics derives from vLLM's internals can go wrong without an error when vLLM
changes under it (the work moved past a hook, arithmetic moved to a caller). Where vLLM
computes the same figure itself, whether or not it logs statistics, the instrumented
scheduler compares the two as the events happen and counts a mismatch in
``kvmetrics_self_check_failures_total{check}`` (:mod:`kvmetrics.vllm.selfcheck`).
Where vLLM computes nothing independent, the family says so here (``checks`` empty, and
why), and the only guard is the verified set: every vLLM function on its code path is
fingerprinted (:mod:`kvmetrics.vllm.source_hashes`), so changed code there
shows as ``kvmetrics_build_info{vllm_verified="false"}``. A test keeps this table
complete and keeps those paths inside the verified set.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmetrics.metrics import catalogue as cat


@dataclass(frozen=True)
class CrossCheck:
    """A family's run-time comparison with vLLM, or the reason there is none."""

    #: Labels of ``kvmetrics_self_check_failures_total`` that compare this family;
    #: empty: vLLM computes no independent figure for it.
    checks: tuple[str, ...]
    #: vLLM's figure compared, or why there is none.
    figure: str


_NO_STATS = "with statistics off vLLM keeps no count of it"
#: The four figures a vLLM with docs/vllm-patches/0005 reports itself; on such a vLLM
#: kvmetrics compares them at every recorded step (kvmetrics/vllm/native_stats.py).
_WITH_0005 = ("; a vLLM with kv_load_failure_stats (docs/vllm-patches/0005) is compared "
              "with at every recorded step (vllm_kv_load_stats)")

CROSS_CHECKS: dict[str, CrossCheck] = {
    cat.PROMPT_TOKENS.name: CrossCheck(
        ("prompt_tokens",),
        "each admission's split (local cache, external) against Request.prefill_stats, "
        "which vLLM sets in the same admission from its own counts"),
    cat.PREFIX_CACHE_HIT_TOKENS.name: CrossCheck(
        ("prompt_tokens",),
        "a first admission's hits are its prompt split (checked as prompt_tokens); a "
        f"repeat admission's are not compared: {_NO_STATS} (PrefixCacheStats exists only "
        "with log_stats, and is recorded inside the hooked record_prefix_cache_stats)"),
    cat.PREFIX_CACHE_QUERY_TOKENS.name: CrossCheck(
        (), f"{_NO_STATS}; with log_stats, PrefixCacheStats is recorded inside the hooked "
        "record_prefix_cache_stats from the same arguments kvmetrics reads"),
    cat.PREEMPTIONS.name: CrossCheck(
        ("preemptions",),
        "each finished request's count against Request.num_preemptions"),
    cat.FINISHED_REQUESTS.name: CrossCheck(
        ("requests_finished",),
        "every request kvmetrics tracks must still be in vLLM's requests table"),
    cat.KV_LOAD_FAILED_REQUESTS.name: CrossCheck(
        ("kv_load_failed_requests",),
        "each recovery call's count against vLLM's own, in its recovery log line"
        + _WITH_0005),
    cat.KV_LOAD_BLOCKS.name: CrossCheck(
        (), "the outcomes are read from the connector's output itself (invalid_block_ids, "
        "finished_recving, failed_recving): vLLM has no other count of loaded blocks"
        + _WITH_0005),
    cat.ROLLED_BACK_TOKENS.name: CrossCheck(
        (), "vLLM's recovery log line counts tokens of requests that share a failed block "
        "differently (it adds the step's scheduled tokens): no equal figure" + _WITH_0005),
    cat.RECOMPUTED_TOKENS.name: CrossCheck(
        (), "vLLM does not know which scheduled tokens it computed before" + _WITH_0005),
    cat.EVICTED_BLOCKS.name: CrossCheck(
        (), f"{_NO_STATS}: its eviction events exist only with KV cache events or "
        "log_stats on (KVEventBatch, KVCacheMetricsCollector)"),
    cat.RECOVERY_DURATION.name: CrossCheck(
        (), "a duration kvmetrics measures; vLLM does not time its recovery path"),
}

#: Families counted in the lab's data plane, not from vLLM's scheduler: no vLLM figure.
LAB_ONLY = (cat.KV_VERIFIED_TOKENS.name, cat.KV_VERIFICATION_FAILED_BLOCKS.name)
