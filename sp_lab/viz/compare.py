"""Two reports (or two ranges of one) side by side: bytes crossing boundaries, collectives, fused ops, compile.

``compare_data`` returns one row per metric (tests assert on it); ``build_compare_figure`` draws grouped bars.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING

import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from sp_lab.compiler.report import COLLECTIVE_KEYS, FUSED_KEYS, SP_MATCH_KEYS, CompileReport
from sp_lab.viz.overview import OP_ABBREVIATIONS
from sp_lab.viz.report_input import as_report, range_label, report_provenance, resolve_range

if TYPE_CHECKING:
    from sp_lab.viz.report_input import ReportSource

__all__ = ["build_compare_figure", "compare_data"]

_COMPARE_UNITS = {"boundary bytes/token": "bytes", "boundary bytes/token/layer": "bytes",
                  "sharded tensors at boundaries": "count", "fused ops": "count",
                  "sp rewrites": "count", "compile time": "s", "cache hits": "count",
                  "failures": "count", "erased copies": "count"}


def _range_metrics(report: CompileReport, ri: int) -> dict[str, float]:
    r = report.ranges[ri]
    n_layers = sum(1 for p in r.pieces if p.kind == "splitting_op") or report.model.get("num_layers") or 1
    counts: dict[str, float] = defaultdict(float)
    for p in r.pieces:
        for k in COLLECTIVE_KEYS:
            counts[k] += p.op_counts_after.get(k, 0)
    crossing = [t for b in r.boundaries for t in b.tensors]
    bytes_per_token = sum(t.bytes_per_token_after or 0.0 for t in crossing)
    return {
        "boundary bytes/token": bytes_per_token,
        "boundary bytes/token/layer": bytes_per_token / n_layers,
        "sharded tensors at boundaries": float(sum(bool(t.sharded_after) for t in crossing)),
        **{f"{k}/layer": counts[k] / n_layers for k in COLLECTIVE_KEYS},
        "fused ops": float(sum(counts[k] for k in FUSED_KEYS)),
        "sp rewrites": float(sum(p.matches.get(k, 0) for p in r.pieces for k in SP_MATCH_KEYS)),
        "compile time": float(r.compile_time_s or math.nan),
        "cache hits": float(sum(p.cache_hit is True for p in r.pieces)),
        "failures": float(len(r.failures)),
        "erased copies": float(len(r.erased_copies)),
    }


def _report_label(report: CompileReport, ri: int) -> str:
    r = report.ranges[ri]
    return f"{report.model.get('name', '?')} {r.boundary} {range_label(r)}"


def compare_data(report_a: ReportSource, report_b: ReportSource, *, range_a: int | None = None, range_b: int | None = None,
                 labels: tuple[str, str] | None = None) -> pl.DataFrame:
    """Two reports (or two ranges of one) side by side, one row per metric.

    Columns: ``metric``, ``unit``, ``a``, ``b``, ``ratio`` (b / a, null where a is 0). The labels
    used for plotting are stored as the ``label_a`` / ``label_b`` columns, where each report was compiled
    (:func:`~sp_lab.viz.report_input.report_provenance`) as ``provenance_a`` / ``provenance_b`` (constant per frame).
    Metrics: bytes crossing boundaries per token (total and per layer), collectives and fused ops
    per layer by kind, fused ops, SP rewrites, compile time, cache hits, failures, erased copies.
    """
    ra, rb = as_report(report_a), as_report(report_b)
    ia, ib = resolve_range(ra, range_a), resolve_range(rb, range_b)
    ma, mb = _range_metrics(ra, ia), _range_metrics(rb, ib)
    la, lb = labels or (_report_label(ra, ia), _report_label(rb, ib))
    if la == lb:
        la, lb = f"{la} (a)", f"{lb} (b)"
    metrics = list(ma)
    return pl.DataFrame({
        "metric": metrics,
        "unit": [_COMPARE_UNITS.get(m, "per layer") for m in metrics],
        "a": [ma[m] for m in metrics], "b": [mb[m] for m in metrics],
    }).with_columns(
        ratio=pl.when(pl.col("a") != 0).then(pl.col("b") / pl.col("a")).otherwise(None),
        label_a=pl.lit(la), label_b=pl.lit(lb), provenance_a=pl.lit(report_provenance(ra)),
        provenance_b=pl.lit(report_provenance(rb)))


# Panel titles on short lines: four panels share a notebook's width (about 200 px each), and a longer title ran
# into its neighbours'.
_COMPARE_PANELS = (
    ("bytes crossing<br>boundaries per token", ("boundary bytes/token", "boundary bytes/token/layer")),
    ("collectives<br>per layer", tuple(f"{k}/layer" for k in COLLECTIVE_KEYS)),
    ("fused ops, rewrites,<br>problems", ("fused ops", "sp rewrites", "failures", "erased copies")),
    ("compile", ("compile time", "cache hits")),
)
# The collectives' tick labels as the explorer's figures abbreviate them (AG+mm/layer); hover gives the full name.
_TICK = {f"{k}/layer": f"{OP_ABBREVIATIONS[k]}/layer" for k in COLLECTIVE_KEYS}


def build_compare_figure(frame: pl.DataFrame) -> go.Figure:
    """Grouped bars, one panel per unit family (bytes, per-layer counts, counts, compile)."""
    la, lb = frame["label_a"][0], frame["label_b"][0]
    pa, pb = frame["provenance_a"][0], frame["provenance_b"][0]
    # Where each was compiled (a fake process group's compile times are one process's): once if they agree.
    title = (f"a: {la}<br>b: {lb}<br><sup>{pa}</sup>" if pa == pb
             else f"a: {la} <sup>({pa})</sup><br>b: {lb} <sup>({pb})</sup>")
    values = {r["metric"]: r for r in frame.iter_rows(named=True)}
    fig = make_subplots(rows=1, cols=len(_COMPARE_PANELS), subplot_titles=[t for t, _ in _COMPARE_PANELS],
                        horizontal_spacing=0.06)
    for col, (_, metrics) in enumerate(_COMPARE_PANELS, start=1):
        metrics = [m for m in metrics if m in values]
        for side, label, color in (("a", la, "#1f77b4"), ("b", lb, "#ff7f0e")):
            fig.add_trace(go.Bar(x=[_TICK.get(m, m) for m in metrics], y=[values[m][side] for m in metrics],
                                 name=label, marker_color=color, legendgroup=side, showlegend=col == 1,
                                 customdata=metrics,
                                 hovertemplate="%{customdata}: %{y:.4g}<extra>" + label + "</extra>"), row=1, col=col)
    # No fixed width: the figure fits the notebook's output area (1500 px was cut at its right edge). The
    # two labels go on two title lines and the metric names are slanted, so neither is clipped.
    fig.update_xaxes(tickangle=-30, automargin=True)
    fig.update_yaxes(automargin=True)
    # The title at the top edge in a margin sized for its lines and the panels' two-line titles under it; the
    # legend at the bottom edge (plotly.js reserves its room), clear of both.
    fig.update_layout(barmode="group", height=540, autosize=True,
                      title={"text": title, "font": {"size": 13}, "yref": "container", "y": 1, "yanchor": "top",
                             "pad": {"t": 20}},
                      legend={"orientation": "h", "yref": "container", "yanchor": "bottom", "y": 0, "x": 0},
                      margin={"l": 40, "r": 20, "t": 40 + 20 * title.count("<br>") + 60, "b": 40})
    return fig
