"""Thin wrappers over grafana-foundation-sdk panel builders.

They fix the conventions every kvmetrics panel follows (Prometheus data source
from the ``$datasource`` variable, explicit ``refId`` per target, a unit and
thresholds on every panel, no panel ``id``) so the dashboard module reads as a
list of queries rather than builder plumbing.
"""

from __future__ import annotations

from collections.abc import Sequence

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import DataSourceRef, Threshold, ThresholdsMode

#: Every panel and target reads the data source the viewer picked.
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")

# Units. ``count:`` is Grafana's scaled custom unit (1.2K tokens/s).
RATIO = "percentunit"
SECONDS = "s"
REQ_PER_S = "reqps"
PER_S = "count:/s"
TOKENS_PER_S = "count:tokens/s"
BLOCKS_PER_S = "count:blocks/s"
COUNT = "short"
NONE = "none"

#: (value, colour) steps; the first step's value is None (minus infinity).
Steps = Sequence[tuple[float | None, str]]

#: Default for panels where no value is bad in itself (rates split by label).
NEUTRAL: Steps = ((None, "green"),)
#: Any non-zero value is an incident (violations, verification failures).
ANY_IS_BAD: Steps = ((None, "green"), (1e-9, "red"))
#: Higher is better (hit ratios).
HIGHER_BETTER: Steps = ((None, "red"), (0.2, "yellow"), (0.5, "green"))

#: Target: (expr, legend format).
Target = tuple[str, str]


def thresholds(steps: Steps) -> dash_b.ThresholdsConfig:
    """Absolute thresholds from ``(value, colour)`` steps."""
    return (
        dash_b.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=value, color=colour) for value, colour in steps])
    )


def _query(ref_id: str, expr: str, legend: str, *, instant: bool) -> prometheus.Dataquery:
    query = (
        prometheus.Dataquery()
        .ref_id(ref_id)
        .expr(expr)
        .legend_format(legend)
        .datasource(DATASOURCE)
    )
    return query.instant() if instant else query.range()


def _ref_id(index: int) -> str:
    """A, B, C... : Grafana's own ref-id scheme, stable across rebuilds."""
    return chr(ord("A") + index)


def time_series(
    title: str,
    description: str,
    unit: str,
    targets: Sequence[Target],
    *,
    steps: Steps = NEUTRAL,
    stacked: bool = False,
    max_value: float | None = None,
    width: int = 12,
) -> timeseries.Panel:
    """A time series panel; ``stacked`` for parts of a whole (evictions by cause)."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .min(0)
        .thresholds(thresholds(steps))
        .fill_opacity(10)
        .span(width)
        .height(8)
        .legend(
            common_b.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI))
    )
    if max_value is not None:
        panel = panel.max(max_value)
    if stacked:
        panel = panel.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
    for index, (expr, legend) in enumerate(targets):
        panel = panel.with_target(_query(_ref_id(index), expr, legend, instant=False))
    return panel


def single_stat(
    title: str,
    description: str,
    unit: str,
    expr: str,
    *,
    steps: Steps,
    legend: str = "",
    instant: bool = False,
    width: int = 4,
    height: int = 4,
) -> stat.Panel:
    """A stat showing the last value, with a sparkline unless the query is instant."""
    panel = (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .thresholds(thresholds(steps))
        .color_mode(common.BigValueColorMode.VALUE)
        .graph_mode(common.BigValueGraphMode.NONE if instant else common.BigValueGraphMode.AREA)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .span(width)
        .height(height)
    )
    return panel.with_target(_query("A", expr, legend, instant=instant))


def row(title: str) -> dash_b.Row:
    """An expanded row: its panels follow it at the top level of the dashboard."""
    return dash_b.Row(title).collapsed(False)
