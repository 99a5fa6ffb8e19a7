"""The run summary: read from the same totals the exporters were fed, never recounted."""

from __future__ import annotations

from typing import Any

from kvmetrics.lab.verdict import (
    FAIL,
    PASS,
    faults_text,
    injected_rate,
    policy_text,
    recompute_note,
    recovery_text,
    verdict,
)
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


#: What each eviction cause (the ``cause`` label) means, for the summary's row.
EVICTION_CAUSES = {"capacity": "to make room", "kv_load_failure": "after failed loads",
                   "reset": "by a prefix-cache reset"}


def _hits(source: dict[str, Any]) -> str:
    """A source's prefix-cache hits, first admissions (the ratio the dashboards show) and
    re-admissions apart: loads happen on both, so a run whose loads all came from
    re-admissions shows 0 hits on first admission next to its loaded blocks."""
    repeat = source["repeat"]
    again = (f", {repeat['hit_tokens']:,}/{repeat['query_tokens']:,} on re-admission "
             "(after a preemption or a failed async load)" if repeat["query_tokens"] else "")
    return (f"{source['hit_tokens']:,}/{source['query_tokens']:,} tokens on first admission "
            f"({source['hit_ratio']:.1%}){again}")


def _loads(summary: dict[str, Any], config: dict[str, Any] | None) -> str:
    k = summary["kv_load"]
    loaded = k["blocks_ok"] + k["blocks_failed"]
    share = f"{k['blocks_failed'] / loaded:.1%} of loaded blocks" if loaded else "none loaded"
    injected = f"; {injected_rate(config)}" if config is not None else ""
    return (f"{k['blocks_ok']:,} ok, {k['blocks_failed']:,} failed ({share}{injected}); "
            f"{k['failed_requests']:,} requests hit by a failed load")


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary as (name, value) rows: the text table's and the HTML report's. With
    the run's ``config`` (a run document), the faults injected and the recovery run are
    repeated next to the figures they shape."""
    r, p = summary["requests"], summary["prefix_cache"]
    config = summary.get("config")
    recomputed = summary["recomputed_tokens"]
    rows = [("engine", str(summary["engine"]))]
    if config is not None:
        rows += [("faults injected", faults_text(config)),
                 ("failure policy", policy_text(config)),
                 ("recovery path", recovery_text(config))]
    rows += [
        ("requests", f"{r['submitted']:,} submitted, {r['finished']:,} finished, "
                     f"{r['failed']:,} failed, {r['aborted']:,} aborted"),
        ("local prefix hits", _hits(p["local"])),
        ("external hits", _hits(p["external"])),
        ("KV load blocks", _loads(summary, config)),
        ("rolled back tokens", f"{summary['rolled_back_tokens']:,} computed tokens taken "
                               "back after failed loads"),
        ("recomputed tokens", f"{recomputed['kv_load_failure']:,} after failed loads"
                              f"{'*' if recompute_note(summary) else ''}, "
                              f"{recomputed['preemption']:,} after preemption"),
        ("evicted blocks", ", ".join(f"{v:,} {EVICTION_CAUSES.get(c, c)}"
                                     for c, v in summary["evicted_blocks"].items())),
        ("preemptions", f"{summary['preemptions']:,}"),
        ("guard rejected increments", str(summary["guard_rejected_increments"])),
        ("invariant violations", str(summary["invariant_violations"])),
        ("verified tokens", f"{summary['verification']['verified_tokens']:,} "
                            f"({summary['verification']['failed_blocks']} stale block reads)"),
        ("steps / wall time", f"{summary['steps']} / {summary['wall_seconds']:.2f} s"),
    ]
    return rows


def footnotes(summary: dict[str, Any]) -> list[str]:
    """Sentences for the figures marked ``*`` in the rows (empty when none is)."""
    note = recompute_note(summary)
    return [f"* {note}"] if note else []


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
    """A compact human table of the summary (the JSON form has every field), the notes
    on its starred figures, what the findings and violations mean, and last the
    verdict. ``rich``: box-drawn, for a terminal. ``summary`` may be the run document
    (with ``config``): the table then repeats the faults injected and the recovery."""
    # A run file's text (an engine name, a request id) is shown by the one escaping rule:
    # no control byte or bidi override reaches the terminal.
    rows = [(name, escape_for_display(str(value))) for name, value in summary_rows(summary)]
    starred = [escape_for_display(line) for line in footnotes(summary)]
    notes = [escape_for_display(line) for line in explanation_lines(summary)]
    judged = verdict(summary)
    line = escape_for_display(judged.line)
    if rich:
        return _rich_table(rows, starred, notes, line, judged.status)
    width = max(len(name) for name, _ in rows)
    text = "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
    return "\n\n".join(part for part in (text, "\n".join(starred), "\n".join(notes), line)
                       if part)


#: The verdict's colour on a terminal.
VERDICT_STYLES = {PASS: "bold green", FAIL: "bold red"}


def _rich_table(rows: list[tuple[str, str]], starred: list[str], notes: list[str],
                line: str, status: str) -> str:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    table.add_column(style="bold")
    table.add_column()
    for name, value in rows:
        table.add_row(name, Text(value))  # Text: a "[red]" in a value is not markup
    console = Console(record=True, width=120, force_terminal=True)
    plain: dict[str, Any] = {"highlight": False, "markup": False}
    with console.capture() as capture:
        console.print(table)
        for note in starred:
            console.print(note, style="dim", **plain)
        if notes:
            console.print()
        for note in notes:
            console.print(note, style="red" if not note.startswith(" ") else None, **plain)
        console.print()
        console.print(line, style=VERDICT_STYLES.get(status, "bold yellow"), **plain)
    return capture.get().rstrip("\n")
