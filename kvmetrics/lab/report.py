"""The run report: one self-contained HTML file with charts over the run's steps.

Charts are drawn server-side by matplotlib as SVG and inlined into the page, so
the file opens offline by construction: no script, no font or stylesheet to
fetch, nothing that names a URL (the SVG namespace declarations, which HTML does
not need, are stripped). The input is the run's JSON document (``kvmetrics run
--output``): the summary, the configuration and the per-step timeline that the
run's :class:`~kvmetrics.lab.timeline.TimelineSink` recorded from the same
guarded increments the exporters saw.
"""

from __future__ import annotations

import html
import io
import math
import re
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

from kvmetrics import __version__
from kvmetrics.lab.summary import explanation_lines, summary_rows

#: Series colours; the browser test looks for them in the rendered page.
COLOURS = {
    "local": "#1f77b4", "external": "#ff7f0e",
    "ok": "#2ca02c", "failed": "#d62728",
    "rolled_back": "#9467bd", "recomputed_kv_load_failure": "#8c564b",
    "recomputed_preemption": "#e377c2",
    "capacity": "#7f7f7f", "kv_load_failure": "#bcbd22", "reset": "#17becf",
    "preemptions": "#e377c2", "usage": "#1f77b4",
    "running": "#2ca02c", "waiting": "#ff7f0e", "waiting_for_remote_kv": "#9467bd",
    "finding": "#d62728", "guard": "#ff7f0e", "invariant": "#000000",
}


class ReportUnavailable(RuntimeError):
    """The report cannot be drawn here (matplotlib missing); the message says what to do."""


class ReportInputError(ValueError):
    """A run document the report cannot chart; the message names the problem."""


def require_report_support() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReportUnavailable(
            "the HTML report needs matplotlib: pip install 'kvmetrics[report]' (or rerun "
            "scripts/install.sh, which installs it)") from None


def _pyplot() -> Any:
    require_report_support()
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update({
        "svg.fonttype": "none",  # real <text>, no glyph outlines: smaller, selectable
        "svg.hashsalt": "kvmetrics",  # stable ids, so equal runs give equal files
        "font.size": 8, "axes.titlesize": 9, "axes.spines.top": False,
        "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
        "legend.fontsize": 7, "legend.frameon": False,
    })
    return plt


def _inline_svg(svg: str, prefix: str) -> str:
    """matplotlib's SVG as an element of an HTML page: no XML prolog, DOCTYPE, metadata or
    namespace URLs, ids made unique per chart, and a width that follows the page."""
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    svg = re.sub(r'\s+xmlns(?::\w+)?="[^"]*"', "", svg)
    svg = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{prefix}{m.group(1)}"', svg)
    svg = re.sub(r'href="#([^"]+)"', lambda m: f'href="#{prefix}{m.group(1)}"', svg)
    svg = re.sub(r"url\(#([^)]+)\)", lambda m: f"url(#{prefix}{m.group(1)})", svg)
    svg = re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"', r'<svg\1 width="100%"', svg,
                 count=1)
    return svg.strip()


class _Timeline:
    def __init__(self, data: dict[str, Any]) -> None:
        try:
            self.width = int(data["bucket_steps"])
            self.steps = [int(s) for s in data["last_step"]]
            self.counters = {k: [float(v) for v in vs] for k, vs in data["counters"].items()}
            self.gauges = {k: [float(v) for v in vs] for k, vs in data["gauges"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ReportInputError(f"the run's timeline is malformed ({e})") from None
        n = len(self.steps)
        for series in (*self.counters.values(), *self.gauges.values()):
            if len(series) != n:
                raise ReportInputError("the run's timeline has series of unequal length")

    def c(self, name: str) -> list[float]:
        return self.counters.get(name, [0.0] * len(self.steps))

    def marks(self, name: str) -> list[int]:
        return [s for s, v in zip(self.steps, self.c(name), strict=True) if v]

    @property
    def per(self) -> str:
        return "per step" if self.width == 1 else f"per {self.width}-step bucket"


def _ratio(hits: Sequence[float], queries: Sequence[float]) -> list[float]:
    return [h / q if q else math.nan for h, q in zip(hits, queries, strict=True)]


Chart = tuple[str, Callable[[Any, _Timeline], None]]


def _charts(tl: _Timeline) -> list[Chart]:
    def line(ax: Any, key: str, values: Sequence[float], label: str) -> None:
        ax.plot(tl.steps, values, color=COLOURS[key], lw=1.2, label=label)

    def hit_ratio(ax: Any, t: _Timeline) -> None:
        # Dots: the ratio of each step (bucket) that looked anything up; line: the run's
        # ratio so far, which is what the summary's figure converges to.
        for source in ("local", "external"):
            hits, queries = t.c(f"{source}_hit_tokens"), t.c(f"{source}_query_tokens")
            ax.plot(t.steps, _ratio(hits, queries), ".", ms=2.5, color=COLOURS[source],
                    alpha=0.45)
            line(ax, source, _ratio(list(accumulate(hits)), list(accumulate(queries))),
                 f"{source}, cumulative (dots: {t.per})")
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("hit tokens / queried")

    def loads(ax: Any, t: _Timeline) -> None:
        line(ax, "ok", t.c("load_blocks_ok"), "ok")
        line(ax, "failed", t.c("load_blocks_failed"), "failed")
        ax.set_ylabel(f"blocks {t.per}")

    def tokens(ax: Any, t: _Timeline) -> None:
        line(ax, "rolled_back", t.c("rolled_back_tokens"), "rolled back")
        line(ax, "recomputed_kv_load_failure", t.c("recomputed_tokens_kv_load_failure"),
             "recomputed: kv_load_failure")
        line(ax, "recomputed_preemption", t.c("recomputed_tokens_preemption"),
             "recomputed: preemption")
        ax.set_ylabel(f"tokens {t.per}")

    def evictions(ax: Any, t: _Timeline) -> None:
        for cause in ("capacity", "kv_load_failure", "reset"):
            line(ax, cause, t.c(f"evicted_blocks_{cause}"), cause)
        ax.set_ylabel(f"blocks {t.per}")

    def preemptions(ax: Any, t: _Timeline) -> None:
        line(ax, "preemptions", t.c("preemptions"), "preemptions")
        ax.set_ylabel(f"preemptions {t.per}")

    def usage(ax: Any, t: _Timeline) -> None:
        line(ax, "usage", t.gauges.get("kv_cache_usage", []), "KV cache usage")
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("share of blocks in use")

    def queues(ax: Any, t: _Timeline) -> None:
        for state in ("running", "waiting", "waiting_for_remote_kv"):
            line(ax, state, t.gauges.get(state, []), state)
        ax.set_ylabel("requests (mean)")

    def findings(ax: Any, t: _Timeline) -> None:
        line(ax, "finding", t.c("verification_failed_blocks"),
             "stale KV block reads (verifier)")
        line(ax, "guard", t.c("guard_rejected_increments"), "guard rejections")
        line(ax, "invariant", t.c("invariant_violations"), "invariant violations")
        ax.set_ylabel(f"events {t.per}")

    return [
        ("Prefix-cache hit ratio", hit_ratio),
        ("KV loads", loads),
        ("Rolled-back and recomputed tokens", tokens),
        ("Evictions by cause", evictions),
        ("Preemptions", preemptions),
        ("KV cache usage", usage),
        ("Requests by state (queue depth)", queues),
        ("Findings", findings),
    ]


def _draw(plt: Any, title: str, draw: Callable[[Any, _Timeline], None], tl: _Timeline,
          marks: list[int], prefix: str) -> str:
    fig, ax = plt.subplots(figsize=(6.2, 2.5))
    try:
        for step in marks:  # where the verifier found stale KV, on every chart
            ax.axvline(step, color=COLOURS["finding"], alpha=0.25, lw=0.8)
        draw(ax, tl)
        ax.set_title(title, loc="left")
        ax.set_xlabel("engine step")
        if tl.steps:
            ax.set_xlim(0, max(tl.steps[-1], 1))
        bottom, top = ax.get_ylim()
        if bottom < 0 <= top:  # counts and ratios start at zero
            ax.set_ylim(-0.02 * max(top, 1), max(top, 1))
        ax.legend(loc="upper right")
        fig.tight_layout(pad=0.4)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    finally:
        plt.close(fig)
    return _inline_svg(buf.getvalue(), prefix)


def _table(rows: Sequence[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_fmt(v))}</td></tr>"
                   for k, v in rows)
    return f"<table>{body}</table>"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return str(value)


CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1320px;color:#222;
padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
.meta{color:#555;margin:0 0 16px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:12px}
figure{margin:0;border:1px solid #ddd;border-radius:6px;padding:6px;background:#fff}
figcaption{font-size:12px;color:#555}
table{border-collapse:collapse}th,td{text-align:left;padding:3px 12px 3px 0;
vertical-align:top;border-bottom:1px solid #eee}th{font-weight:600}
.findings{border-left:4px solid #d62728;padding:8px 12px;background:#fdf3f3;
white-space:pre-wrap;font:13px/1.5 ui-monospace,monospace}
.clean{border-left:4px solid #2ca02c;padding:8px 12px;background:#f3fbf3}
"""


def render_report(document: dict[str, Any]) -> str:
    """The HTML page for one run document (see :meth:`LabResult.document`)."""
    if not isinstance(document, dict) or "timeline" not in document:
        raise ReportInputError("the run document has no timeline (write it with "
                               "`kvmetrics run --output RUN.json`)")
    for key in ("engine", "requests", "steps", "verification"):
        if key not in document:
            raise ReportInputError(f"the run document has no {key!r} field")
    tl = _Timeline(document["timeline"])
    plt = _pyplot()
    marks = tl.marks("verification_failed_blocks")
    figures = []
    for i, (title, draw) in enumerate(_charts(tl)):
        svg = _draw(plt, title, draw, tl, marks, f"c{i}-")
        figures.append(f'<figure class="chart" data-chart="{i}">{svg}'
                       f"<figcaption>{html.escape(tl.per)}"
                       f"{'; red lines: steps with stale KV reads' if marks else ''}"
                       f"</figcaption></figure>")
    notes = explanation_lines(document)
    if notes:
        findings = f'<div class="findings">{html.escape(chr(10).join(notes))}</div>'
    else:
        findings = ('<div class="clean">No stale KV read, no guard rejection, no invariant '
                    "violation.</div>")
    config = document.get("config") or {}
    r = document["requests"]
    meta = (f"engine {document['engine']} &middot; {r['submitted']} requests &middot; "
            f"{document['steps']} steps &middot; {document.get('wall_seconds', 0):.2f} s "
            f"&middot; kvmetrics {html.escape(__version__)}")
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>kvmetrics run report</title>", f"<style>{CSS}</style></head><body>",
        "<h1>kvmetrics run report</h1>", f'<p class="meta">{meta}</p>',
        '<h2 id="findings">Findings</h2>', findings,
        '<h2 id="charts">Over the run</h2>', '<div class="grid">', *figures, "</div>",
        '<h2 id="summary">Summary</h2>', _table(summary_rows(document)),
        '<h2 id="configuration">Configuration</h2>', _table(sorted(config.items())),
        "</body></html>", ""])
