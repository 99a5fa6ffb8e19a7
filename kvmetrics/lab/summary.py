"""The run summary: read from the same totals the exporters were fed, never recounted."""

from __future__ import annotations

from typing import Any

from kvmetrics.metrics import catalogue as cat
from kvmetrics.metrics.text import escape_for_display
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


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary as (name, value) rows: the text table's and the HTML report's."""
    r, p, k = summary["requests"], summary["prefix_cache"], summary["kv_load"]
    return [
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
                            f"({summary['verification']['failed_blocks']} stale block reads)"),
        ("steps / wall time", f"{summary['steps']} / {summary['wall_seconds']:.2f} s"),
    ]


def explanation_lines(summary: dict[str, Any]) -> list[str]:
    """Plain sentences about the findings and violations (empty for a clean run)."""
    lines: list[str] = []
    f = summary.get("findings") or {}
    if f.get("failed_blocks"):
        lines.append(f"stale KV: {f['failed_blocks']} stale block reads by {f['requests']} "
                     f"request(s) in {f['blocks']} distinct block(s), first at step "
                     f"{f['first_step']}")
        for c in f["causes"]:
            lines.append(f"  {c['failed_blocks']} stale block read(s), {c['requests']} "
                         f"request(s), {c['blocks']} block(s) from step {c['first_step']}: "
                         f"{c['explanation']}")
            lines.append(f"    e.g. {c['example']}")
            if c["docs"]:
                lines.append(f"    see {c['docs']}")
            if c["avoid"]:
                lines.append(f"    avoid it with {c['avoid']}")
    for v in summary.get("violations") or ():
        if v["kind"] == "invariant":
            what = f"invariant {v['invariant']} broken ({v['metric']})"
        else:
            what = f"{v['reason'].replace('_', '-')} increments of {v['metric']} rejected by " \
                "the guard"
        who = f", first request {v['first_request']}" if v["first_request"] else ""
        lines.append(f"{what}: {v['count']} time(s), first at step {v['first_step']}{who}")
        lines.append(f"    e.g. {v['examples'][0]}")
    return lines


def render_table(summary: dict[str, Any], rich: bool = False) -> str:
    """A compact human table of the summary (the JSON form has every field), then what
    the findings and violations mean. ``rich``: box-drawn, for a terminal."""
    # A run file's text (an engine name, a request id) is shown by the one escaping rule:
    # no control byte or bidi override reaches the terminal.
    rows = [(name, escape_for_display(str(value))) for name, value in summary_rows(summary)]
    notes = [escape_for_display(line) for line in explanation_lines(summary)]
    if rich:
        return _rich_table(rows, notes)
    width = max(len(name) for name, _ in rows)
    text = "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
    return text + ("\n\n" + "\n".join(notes) if notes else "")


def _rich_table(rows: list[tuple[str, str]], notes: list[str]) -> str:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    table.add_column(style="bold")
    table.add_column()
    for name, value in rows:
        table.add_row(name, Text(value))  # Text: a "[red]" in a value is not markup
    console = Console(record=True, width=120, force_terminal=True)
    with console.capture() as capture:
        console.print(table)
        for line in notes:
            console.print(line, style="red" if not line.startswith(" ") else None,
                          highlight=False, markup=False)
    return capture.get().rstrip("\n")
