"""The run summary: read from the same totals the exporters were fed, never recounted."""

from __future__ import annotations

from typing import Any

from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.totals import Totals


def _ratio(hit: float, queried: float) -> float:
    return round(hit / queried, 6) if queried else 0.0


def build_summary(totals: Totals, *, engine: str, submitted: int, wall_seconds: float,
                  steps: int) -> dict[str, Any]:
    def t(spec: cat.MetricSpec, **labels: str) -> int:
        return int(totals.get(spec, **labels))

    prefix: dict[str, Any] = {}
    for source in cat.SOURCE:
        # The ratio of first admissions (what the dashboards show); re-admissions after
        # preemption look their own KV up again and are listed apart.
        q = t(cat.PREFIX_CACHE_QUERY_TOKENS, source=source, admission="first")
        h = t(cat.PREFIX_CACHE_HIT_TOKENS, source=source, admission="first")
        prefix[source] = {"query_tokens": q, "hit_tokens": h, "hit_ratio": _ratio(h, q),
                          "repeat": {
                              "query_tokens": t(cat.PREFIX_CACHE_QUERY_TOKENS, source=source,
                                                admission="repeat"),
                              "hit_tokens": t(cat.PREFIX_CACHE_HIT_TOKENS, source=source,
                                              admission="repeat")}}
    return {
        "engine": engine,
        "requests": {
            "submitted": submitted,
            "finished": t(cat.FINISHED_REQUESTS, reason="stopped")
            + t(cat.FINISHED_REQUESTS, reason="length"),
            "failed": t(cat.FINISHED_REQUESTS, reason="error"),
            "aborted": t(cat.FINISHED_REQUESTS, reason="aborted"),
        },
        "prefix_cache": prefix,
        "prompt_tokens": {s: t(cat.PROMPT_TOKENS, source=s)
                          for s in ("compute", "local_cache", "external")},
        "kv_load": {
            "blocks_ok": t(cat.KV_LOAD_BLOCKS, outcome="ok"),
            "blocks_failed": t(cat.KV_LOAD_BLOCKS, outcome="failed"),
            "failed_requests": t(cat.KV_LOAD_FAILED_REQUESTS),
        },
        "rolled_back_tokens": t(cat.ROLLED_BACK_TOKENS),
        "recomputed_tokens": {c: t(cat.RECOMPUTED_TOKENS, cause=c)
                              for c in ("kv_load_failure", "preemption")},
        "evicted_blocks": {c: t(cat.EVICTED_BLOCKS, cause=c)
                           for c in ("capacity", "kv_load_failure", "reset")},
        "preemptions": t(cat.PREEMPTIONS),
        "guard_rejected_increments": t(cat.GUARD_REJECTED_INCREMENTS),
        "invariant_violations": t(cat.INVARIANT_VIOLATIONS),
        "verification": {
            "verified_tokens": t(cat.KV_VERIFIED_TOKENS),
            "failed_blocks": t(cat.KV_VERIFICATION_FAILED_BLOCKS),
        },
        "steps": steps,
        "wall_seconds": round(wall_seconds, 3),
    }


def render_table(summary: dict[str, Any]) -> str:
    """A compact human table of the summary (the JSON form has every field)."""
    r, p, k = summary["requests"], summary["prefix_cache"], summary["kv_load"]
    rows = [
        ("engine", summary["engine"]),
        ("requests", f"{r['submitted']} submitted, {r['finished']} finished, "
                     f"{r['failed']} failed, {r['aborted']} aborted"),
        ("local prefix hits", f"{p['local']['hit_tokens']}/{p['local']['query_tokens']} tokens "
                              f"({p['local']['hit_ratio']:.4f})"),
        ("external hits", f"{p['external']['hit_tokens']}/{p['external']['query_tokens']} "
                          f"tokens ({p['external']['hit_ratio']:.4f})"),
        ("KV load blocks", f"{k['blocks_ok']} ok, {k['blocks_failed']} failed "
                           f"({k['failed_requests']} requests hit)"),
        ("rolled back tokens", str(summary["rolled_back_tokens"])),
        ("recomputed tokens", ", ".join(f"{v} {c}" for c, v in
                                        summary["recomputed_tokens"].items())),
        ("evicted blocks", ", ".join(f"{v} {c}" for c, v in summary["evicted_blocks"].items())),
        ("preemptions", str(summary["preemptions"])),
        ("guard rejected increments", str(summary["guard_rejected_increments"])),
        ("invariant violations", str(summary["invariant_violations"])),
        ("verified tokens", f"{summary['verification']['verified_tokens']} "
                            f"({summary['verification']['failed_blocks']} failed blocks)"),
        ("steps / wall time", f"{summary['steps']} / {summary['wall_seconds']:.2f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
