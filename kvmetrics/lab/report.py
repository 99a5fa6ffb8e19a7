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

import bisect
import io
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from kvmetrics import __version__
from kvmetrics.lab.doc_sections import DOCS_DIR, DocAppendix, render_appendix
from kvmetrics.lab.markup import Markup, html, join
from kvmetrics.lab.report_headline import cards, command_markup, tiles, verdict_banner, with_options
from kvmetrics.lab.run_schema import RunDocumentError, check_run_document
from kvmetrics.lab.summary import EVICTION_CAUSES, footnotes, summary_rows

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
            self.wall = [float(w) for w in data.get("wall_s", ())]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ReportInputError(f"the run's timeline is malformed ({e})") from None
        n = len(self.steps)
        for series in (*self.counters.values(), *self.gauges.values()):
            if len(series) != n:
                raise ReportInputError("the run's timeline has series of unequal length")

    def c(self, name: str) -> list[float]:
        return self.counters.get(name, [0.0] * len(self.steps))

    def moved(self, *names: str) -> bool:
        return any(any(self.counters.get(n, ())) or any(self.gauges.get(n, ())) for n in names)

    def spans(self, name: str) -> list[tuple[float, float]]:
        """Stretches of consecutive buckets where ``name`` moved, as (first, last) step:
        one shaded band per stretch, not a line per step."""
        spans: list[tuple[float, float]] = []
        previous = 0
        for step, value in zip(self.steps, self.c(name), strict=True):
            if value:
                first = previous + 1
                if spans and spans[-1][1] >= previous:
                    spans[-1] = (spans[-1][0], step)
                else:
                    spans.append((first, step))
            previous = step
        return spans

    def marks(self, name: str) -> list[int]:
        return [s for s, v in zip(self.steps, self.c(name), strict=True) if v]

    @property
    def per(self) -> str:
        return "per step" if self.width == 1 else f"per {self.width}-step bucket"


def _ratio(hits: Sequence[float], queries: Sequence[float]) -> list[float]:
    return [h / q if q else math.nan for h, q in zip(hits, queries, strict=True)]


@dataclass(frozen=True)
class Chart:
    title: str
    draw: Callable[[Any, _Timeline], None]
    #: Timeline series of which one must have moved for the chart to be drawn at all.
    series: tuple[str, ...]


def _charts(tl: _Timeline) -> list[Chart]:
    def line(ax: Any, key: str, values: Sequence[float], label: str, **kw: Any) -> None:
        ax.plot(tl.steps, values, color=COLOURS[key], lw=1.2, label=label, **kw)

    def hit_ratio(ax: Any, t: _Timeline) -> None:
        # Dots: the ratio of each step (bucket) that looked anything up; line: the run's
        # ratio so far, which is what the summary's figure converges to.
        for source in ("local", "external"):
            hits, queries = t.c(f"{source}_hit_tokens"), t.c(f"{source}_query_tokens")
            if not any(queries):
                continue
            ax.plot(t.steps, _ratio(hits, queries), ".", ms=2.5, color=COLOURS[source],
                    alpha=0.45)
            line(ax, source, _ratio(list(accumulate(hits)), list(accumulate(queries))),
                 f"{source}, cumulative (dots: {t.per})")
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("hit tokens / queried")

    def loads(ax: Any, t: _Timeline) -> None:
        # Failed loads are a few per hundred ok ones: on the ok axis they would be a flat
        # line at zero, so they get their own axis (right, red) and a marker per bucket.
        line(ax, "ok", t.c("load_blocks_ok"), "ok (left axis)")
        ax.set_ylabel(f"ok blocks {t.per}")
        failed = t.c("load_blocks_failed")
        right = ax.twinx()
        right.spines["right"].set_visible(True)
        right.plot(t.steps, failed, color=COLOURS["failed"], lw=1.0, label="failed (right axis)")
        marks = [(st, v) for st, v in zip(t.steps, failed, strict=True) if v]
        if marks:
            right.plot(*zip(*marks, strict=True), "v", color=COLOURS["failed"], ms=3.5)
        right.set_ylim(0, max(max(failed, default=0), 1) * 1.15)
        right.set_ylabel("failed blocks", color=COLOURS["failed"])
        right.tick_params(axis="y", colors=COLOURS["failed"])
        right.grid(False)
        handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="upper left")

    def tokens(ax: Any, t: _Timeline) -> None:
        for key, series, label in (
                ("rolled_back", "rolled_back_tokens", "rolled back"),
                ("recomputed_kv_load_failure", "recomputed_tokens_kv_load_failure",
                 "recomputed after failed loads"),
                ("recomputed_preemption", "recomputed_tokens_preemption",
                 "recomputed after preemption")):
            if t.moved(series):
                line(ax, key, t.c(series), label)
        ax.set_ylabel(f"tokens {t.per}")

    def evictions(ax: Any, t: _Timeline) -> None:
        for cause in ("capacity", "kv_load_failure", "reset"):
            if t.moved(f"evicted_blocks_{cause}"):
                line(ax, cause, t.c(f"evicted_blocks_{cause}"), EVICTION_CAUSES[cause])
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
            if t.moved(state):
                line(ax, state, t.gauges.get(state, []), state)
        ax.set_ylabel("requests (mean)")

    def findings(ax: Any, t: _Timeline) -> None:
        for key, series, label in (
                ("finding", "verification_failed_blocks", "stale KV block reads (verifier)"),
                ("guard", "guard_rejected_increments", "guard rejections"),
                ("invariant", "invariant_violations", "invariant violations")):
            if t.moved(series):
                line(ax, key, t.c(series), label, drawstyle="steps-mid")
        ax.set_ylabel(f"events {t.per}")

    return [
        Chart("Findings", findings, ("verification_failed_blocks",
                                     "guard_rejected_increments", "invariant_violations")),
        Chart("KV loads: ok and failed", loads, ("load_blocks_ok", "load_blocks_failed")),
        Chart("Prefix-cache hit ratio", hit_ratio, ("local_query_tokens",
                                                    "external_query_tokens")),
        Chart("Rolled-back and recomputed tokens", tokens, (
            "rolled_back_tokens", "recomputed_tokens_kv_load_failure",
            "recomputed_tokens_preemption")),
        Chart("Evictions by cause", evictions, ("evicted_blocks_capacity",
                                                "evicted_blocks_kv_load_failure",
                                                "evicted_blocks_reset")),
        Chart("Preemptions", preemptions, ("preemptions",)),
        Chart("KV cache usage", usage, ("kv_cache_usage",)),
        Chart("Requests by state (queue depth)", queues, ("running", "waiting",
                                                          "waiting_for_remote_kv")),
    ]


def _draw(plt: Any, chart: Chart, tl: _Timeline, spans: list[tuple[float, float]],
          prefix: str) -> str:
    fig, ax = plt.subplots(figsize=(6.2, 2.6))
    try:
        for first, last in spans:  # where the verifier found stale KV, on every chart
            ax.axvspan(first - 0.5, last + 0.5, color=COLOURS["finding"], alpha=0.10, lw=0)
        chart.draw(ax, tl)
        ax.set_title(chart.title, loc="left")
        ax.set_xlabel("engine step")
        if tl.steps:
            ax.set_xlim(0, max(tl.steps[-1], 1))
        bottom, top = ax.get_ylim()
        if bottom < 0 <= top:  # counts and ratios start at zero
            ax.set_ylim(-0.02 * max(top, 1), max(top, 1))
        if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best")  # away from the lines (usage sits near the top)
        _wall_axis(ax, tl)
        fig.tight_layout(pad=0.4)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None})
    finally:
        plt.close(fig)
    return _inline_svg(buf.getvalue(), prefix)


def _wall_axis(ax: Any, tl: _Timeline) -> None:
    """Wall seconds along the top, mapped from steps by the run's own clock readings."""
    if len(tl.wall) != len(tl.steps) or len(tl.steps) < 2 or tl.wall[-1] <= 0:
        return
    steps = [0.0, *map(float, tl.steps)]
    wall = list(accumulate([0.0, *tl.wall], max))  # a clock never runs backwards

    def to_wall(x: Any) -> Any:
        return _interp(x, steps, wall)

    def to_step(w: Any) -> Any:
        return _interp(w, wall, steps)

    top = ax.secondary_xaxis("top", functions=(to_wall, to_step))
    top.set_xlabel("wall seconds", fontsize=7, color="#666")
    top.tick_params(labelsize=7, colors="#666")


def _interp(x: Any, xs: list[float], ys: list[float]) -> Any:
    """Piecewise-linear ``ys`` at ``x`` (an array of positions, as matplotlib passes),
    clamped at the ends; ``xs`` ascending."""
    out = x.copy() if hasattr(x, "copy") else list(x)
    for i, value in enumerate(x):
        j = min(max(bisect.bisect_right(xs, value), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
        t = 0.0 if x1 == x0 else min(max((value - x0) / (x1 - x0), 0.0), 1.0)
        out[i] = y0 + t * (y1 - y0)
    return out


CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1320px;color:#222;
padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px}
h3{font-size:13px;margin:12px 0 4px;color:#555;text-transform:uppercase;letter-spacing:.04em}
.meta{color:#555;margin:0 0 16px}
.tiles{display:grid;grid-template-columns:repeat(auto-fit,minmax(190px,1fr));gap:10px}
.tile{border:1px solid #ddd;border-radius:6px;padding:10px 12px;background:#fafafa}
.tile .v{font-size:26px;font-weight:600}.tile .l{color:#555;font-size:12px}
.tile.bad{border-color:#d62728;background:#fdf3f3}.tile.bad .v{color:#b01d1e}
.tile.good{border-color:#2ca02c;background:#f3fbf3}
.cards{display:grid;gap:10px}
.card{border:1px solid #e3b4b4;border-left:5px solid #d62728;border-radius:6px;
padding:10px 14px;background:#fff}
.card.violation{border-left-color:#ff7f0e;border-color:#f0d0b0}
.card h4{margin:0 0 4px;font-size:15px}.card .n{color:#555;font-size:12px}
.card p{margin:6px 0}.card .eg{color:#444;font-size:12.5px}
.card a{color:#0b5cad}
.clean{border-left:5px solid #2ca02c;padding:10px 14px;background:#f3fbf3;border-radius:6px}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:12px}
figure{margin:0;border:1px solid #ddd;border-radius:6px;padding:6px;background:#fff}
figcaption{font-size:12px;color:#555}
table{border-collapse:collapse}th,td{text-align:left;padding:3px 12px 3px 0;
vertical-align:top;border-bottom:1px solid #eee}th{font-weight:600}
.config{display:grid;grid-template-columns:repeat(auto-fit,minmax(300px,1fr));gap:4px 24px}
code{font:12.5px ui-monospace,monospace;background:#f4f4f4;padding:1px 4px;border-radius:3px}
.replay{overflow-wrap:anywhere}.replay .arg,.opt,.nw,.card a,th{white-space:nowrap}
.verdict{margin:0 0 12px;padding:8px 14px;border-radius:6px;border-left:5px solid #999;
background:#f6f6f6;font-size:15px}.verdict.pass{border-left-color:#2ca02c;background:#f3fbf3}
.verdict.fail{border-left-color:#d62728;background:#fdf3f3}.verdict.fail b{color:#b01d1e}
.verdict .under{display:block;color:#555;font-size:12.5px;margin-top:2px}
.tile .v small{font-size:13px;font-weight:400;color:#555}.tile{overflow-wrap:anywhere}
.note{color:#555;font-size:12.5px;max-width:960px}
.doc{border-top:1px solid #ddd;margin-top:10px}.doc .src{color:#777;font-size:12px;margin:0}
.doctext{font-size:13px;max-width:960px}.doctext pre{white-space:pre-wrap;font-size:12px;
background:#f6f6f6;padding:6px 8px;border-radius:4px}.doc h3{text-transform:none}
"""


def _table(rows: Sequence[tuple[str, Any]]) -> Markup:
    body = join(html("<tr><th>{}</th><td>{}</td></tr>", k, with_options(_fmt(v)))
                for k, v in rows)
    return html("<table>{}</table>", body)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return str(value)


def _watching_option(field: str, value: Any) -> tuple[str, Any]:
    """A setting outside the replay line as its ``kvmetrics run`` option shows it (a
    switch: given or not), so that the whole table reads as the command line."""
    flag = "--" + field.replace("_", "-")
    if isinstance(value, bool):
        return flag, "given" if value else "not given"
    return flag, value


def _config(config: dict[str, Any]) -> Markup:
    from kvmetrics.lab.config import LabConfig
    from kvmetrics.lab.replay import RUN_OPTIONS, run_arguments

    groups: dict[str, list[tuple[str, Any]]] = {}
    known = {o.field for o in RUN_OPTIONS}
    for option in RUN_OPTIONS:
        if config.get(option.field) is not None:  # unset (no trace, no plan): not shown
            groups.setdefault(option.group, []).append(
                (option.flag, option.shown(config[option.field])))
    other = sorted(_watching_option(k, v) for k, v in config.items() if k not in known)
    if other:
        groups["watching the run (not replayed)"] = other
    parts = join(html("<div><h3>{}</h3>{}</div>", name, _table(rows))
                 for name, rows in groups.items())
    fields = {k: v for k, v in config.items() if k in LabConfig.__dataclass_fields__}
    argv = ["kvmetrics", "run", *run_arguments(LabConfig(**fields))]
    head = html('<p>Replay it: <code class="replay">{}</code></p>', command_markup(argv))
    return html('{}<div class="config">{}</div>', head, parts)


def _cut_short(document: dict[str, Any]) -> Markup | str:
    """Why the run ended before its workload did, for the line under the title: an
    interrupt, a stall or a --strict stop (the figures cover the steps it ran)."""
    if document.get("interrupted"):
        return html(" &middot; <b>interrupted ({}): partial run</b>", document["interrupted"])
    for key in ("stalled", "stopped"):
        if document.get(key):
            return html(' &middot; <b class="cut">partial run: {}</b>', document[key])
    return ""


def render_report(document: dict[str, Any], docs_dir: Path = DOCS_DIR) -> str:
    """The HTML page for one run document (see :meth:`LabResult.document`), with the
    sections of the docs in ``docs_dir`` that it links to copied in."""
    try:
        check_run_document(document)
    except RunDocumentError as e:
        raise ReportInputError(str(e)) from None
    tl = _Timeline(document["timeline"])
    base = DocAppendix(docs_dir)
    try:
        banner, headline = verdict_banner(document), tiles(document)
        found = cards(document, base)
        rows, config = summary_rows(document), _config(document.get("config") or {})
        notes = join(html('<p class="note">{}</p>', line) for line in footnotes(document))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise ReportInputError(f"the run document is malformed ({type(e).__name__}: "
                               f"{str(e)[:80]})") from None
    plt = _pyplot()
    spans = tl.spans("verification_failed_blocks")
    figures = []
    for i, chart in enumerate(c for c in _charts(tl) if tl.moved(*c.series)):
        svg = Markup(_draw(plt, chart, tl, spans, f"c{i}-"))  # matplotlib escapes its text
        figures.append(html('<figure class="chart" data-chart="{}">{}<figcaption>{}{}'
                            "</figcaption></figure>", i, svg, tl.per,
                            "; red bands: steps with stale KV reads" if spans else ""))
    r = document["requests"]
    meta = html("engine {engine} &middot; {submitted:,} requests &middot; {steps:,} steps "
                "&middot; {wall:.2f} s &middot; kvmetrics {version}{cut}",
                engine=document["engine"], submitted=r["submitted"], steps=document["steps"],
                wall=document.get("wall_seconds", 0), version=__version__,
                cut=_cut_short(document))
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>kvmetrics run report</title>",
        html("<style>{}</style></head><body>", Markup(CSS)),
        "<h1>kvmetrics run report</h1>", html('<p class="meta">{}</p>', meta),
        banner, headline,
        '<h2 id="findings">Findings</h2>', found,
        '<h2 id="charts">Over the run</h2>', '<div class="grid">', *figures, "</div>",
        '<h2 id="summary">Summary</h2>', _table(rows), notes,
        '<h2 id="configuration">Configuration</h2>', config,
        render_appendix(base, __version__),
        "</body></html>", ""])
