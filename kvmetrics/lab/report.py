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

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvmetrics import __version__
from kvmetrics.lab.doc_sections import DOCS_DIR, DocAppendix, render_appendix
from kvmetrics.lab.markup import Markup, html, join
from kvmetrics.lab.report_charts import (
    COLOURS,
    ReportInputError,
    ReportUnavailable,
    Timeline,
    charts,
    draw_chart,
    pyplot,
    require_report_support,
)
from kvmetrics.lab.report_headline import cards, command_markup, tiles, verdict_banner, with_options
from kvmetrics.lab.run_schema import RunDocumentError, check_run_document
from kvmetrics.lab.summary import footnotes, summary_rows

# The charts' module's errors and colours are part of this module's surface: the
# commands and the browser test import them from here.
__all__ = ["COLOURS", "ReportInputError", "ReportUnavailable", "render_report",
           "require_report_support"]

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
    tl = Timeline(document["timeline"])
    base = DocAppendix(docs_dir)
    try:
        banner, headline = verdict_banner(document), tiles(document)
        found = cards(document, base)
        rows, config = summary_rows(document), _config(document.get("config") or {})
        notes = join(html('<p class="note">{}</p>', line) for line in footnotes(document))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise ReportInputError(f"the run document is malformed ({type(e).__name__}: "
                               f"{str(e)[:80]})") from None
    plt = pyplot()
    spans = tl.spans("verification_failed_blocks")
    figures = []
    for i, chart in enumerate(c for c in charts(tl) if tl.moved(*c.series)):
        svg = Markup(draw_chart(plt, chart, tl, spans, f"c{i}-"))  # matplotlib escapes its text
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
