"""The run report's charts: the run's timeline, drawn by matplotlib as inline SVG.

Each :class:`Chart` names the timeline series it needs and is drawn only when one of
them moved; every chart shades the steps where the verifier found stale KV reads and
carries wall seconds along its top. :func:`draw_chart` returns an ``<svg>`` element
ready for an HTML page (:mod:`kvmetrics.lab.report` assembles the page).
"""

from __future__ import annotations

import bisect
import io
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from kvmetrics.lab.summary import EVICTION_CAUSES

__all__ = ["COLOURS", "Chart", "ReportInputError", "ReportUnavailable", "Timeline", "charts",
           "draw_chart", "pyplot", "require_report_support"]

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


def pyplot() -> Any:
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


class Timeline:
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
    draw: Callable[[Any, Timeline], None]
    #: Timeline series of which one must have moved for the chart to be drawn at all.
    series: tuple[str, ...]


def charts(tl: Timeline) -> list[Chart]:
    def line(ax: Any, key: str, values: Sequence[float], label: str, **kw: Any) -> None:
        ax.plot(tl.steps, values, color=COLOURS[key], lw=1.2, label=label, **kw)

    def hit_ratio(ax: Any, t: Timeline) -> None:
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

    def loads(ax: Any, t: Timeline) -> None:
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

    def tokens(ax: Any, t: Timeline) -> None:
        for key, series, label in (
                ("rolled_back", "rolled_back_tokens", "rolled back"),
                ("recomputed_kv_load_failure", "recomputed_tokens_kv_load_failure",
                 "recomputed after failed loads"),
                ("recomputed_preemption", "recomputed_tokens_preemption",
                 "recomputed after preemption")):
            if t.moved(series):
                line(ax, key, t.c(series), label)
        ax.set_ylabel(f"tokens {t.per}")

    def evictions(ax: Any, t: Timeline) -> None:
        for cause in ("capacity", "kv_load_failure", "reset"):
            if t.moved(f"evicted_blocks_{cause}"):
                line(ax, cause, t.c(f"evicted_blocks_{cause}"), EVICTION_CAUSES[cause])
        ax.set_ylabel(f"blocks {t.per}")

    def preemptions(ax: Any, t: Timeline) -> None:
        line(ax, "preemptions", t.c("preemptions"), "preemptions")
        ax.set_ylabel(f"preemptions {t.per}")

    def usage(ax: Any, t: Timeline) -> None:
        line(ax, "usage", t.gauges.get("kv_cache_usage", []), "KV cache usage")
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("share of blocks in use")

    def queues(ax: Any, t: Timeline) -> None:
        for state in ("running", "waiting", "waiting_for_remote_kv"):
            if t.moved(state):
                line(ax, state, t.gauges.get(state, []), state)
        ax.set_ylabel("requests (mean)")

    def findings(ax: Any, t: Timeline) -> None:
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


def draw_chart(plt: Any, chart: Chart, tl: Timeline, spans: list[tuple[float, float]],
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


def _wall_axis(ax: Any, tl: Timeline) -> None:
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
