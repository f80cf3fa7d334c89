"""Plots of the serving answer (:mod:`sp_lab.serving`): data -> figure -> ``plot_*``.

- :func:`plot_step_sizes`: the latency curves per variant on top, the traffic's step-size histogram (share of
  steps and of step time under baseline) below on the same token axis, with the per-count and the
  traffic-weighted thresholds as vertical lines: where the traffic's time sits against where fusion pays;
- :func:`plot_latencies`: TTFT and TPOT at p50 / p90 / p99 per policy.

Every title says whether the rows are measured or predicted.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from sp_lab.serving.on_rows import CONCURRENCY, REQUESTS
from sp_lab.viz.latency import VARIANT_COLORS
from sp_lab.vocabulary import describe_threshold

if TYPE_CHECKING:
    from sp_lab.serving.step_costs import LatencyCurves
    from sp_lab.serving.verdict import TrafficVerdict

__all__ = ["curves_data", "histogram_data", "latencies_data", "latencies_figure", "plot_latencies",
           "plot_step_sizes", "step_sizes_figure", "traffic_section_html"]


# --------------------------------------------------------------------------------------------------- data
def curves_data(curves: LatencyCurves, max_tokens: int | None = None) -> pl.DataFrame:
    """``variant, num_tokens, latency_us`` of every curve (rows up to ``max_tokens``)."""
    parts = [pl.DataFrame({"variant": v, "num_tokens": c.tokens.tolist(), "latency_us": c.latency_us.tolist()})
             for v, c in curves.curves.items()]
    frame = pl.concat(parts)
    return frame if max_tokens is None else frame.filter(pl.col("num_tokens") <= max_tokens)


def histogram_data(verdict: TrafficVerdict) -> pl.DataFrame:
    """``low, high, steps, step_share, time_share`` of baseline's step sizes."""
    return pl.DataFrame([{"low": b.low, "high": b.high, "steps": b.steps, "step_share": b.step_share,
                          "time_share": b.time_share} for b in verdict.histogram])


def latencies_data(verdict: TrafficVerdict) -> pl.DataFrame:
    """``policy, metric (TTFT / TPOT), percentile (p50 / p90 / p99), ms`` for policies with requests."""
    rows = []
    for r in verdict.results:
        for metric, p in (("TTFT", r.ttft), ("TPOT", r.tpot)):
            if p is not None:
                rows += [{"policy": r.policy, "metric": metric, "percentile": q, "ms": getattr(p, f"{q}_ms")}
                         for q in ("p50", "p90", "p99")]
    return pl.DataFrame(rows, schema={"policy": pl.String, "metric": pl.String, "percentile": pl.String,
                                      "ms": pl.Float64})


# ------------------------------------------------------------------------------------------------ figures
def step_sizes_figure(curves: pl.DataFrame, histogram: pl.DataFrame, *, per_count: int | None,
                      traffic_weighted: int | None, source: str, title: str = "") -> go.Figure:
    """Latency curves (top) over the step-size histogram (bottom), one log token axis, thresholds marked."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4],
                        subplot_titles=(f"step latency per variant ({source} rows)",
                                        "this traffic's steps under baseline"))
    for (variant,), part in curves.sort("num_tokens").group_by("variant", maintain_order=True):
        fig.add_trace(go.Scatter(x=part["num_tokens"].to_list(), y=(part["latency_us"] / 1e3).to_list(),
                                 name=f"{variant} ({source})", mode="lines",
                                 line={"color": VARIANT_COLORS.get(str(variant), "#444"),
                                       "dash": "solid" if source == "measured" else "dash"},
                                 hovertemplate="%{x} tokens: %{y:.2f} ms<extra>" + str(variant) + "</extra>"),
                      row=1, col=1)
    # the histogram as one box per bin over its token range (down to 0 on both sides, so empty bins between
    # stay empty), drawn as lines so it shares the curves' log axis
    xs, steps, times = [], [], []
    for b in histogram.iter_rows(named=True):
        xs += [b["low"], b["low"], b["high"] + 1, b["high"] + 1]
        steps += [0.0, 100 * b["step_share"], 100 * b["step_share"], 0.0]
        times += [0.0, 100 * b["time_share"], 100 * b["time_share"], 0.0]
    fig.add_trace(go.Scatter(x=xs, y=times, name="share of step time", mode="lines", fill="tozeroy",
                             line={"color": "#d62728"}, hovertemplate="%{x} tokens: %{y:.1f}% of time<extra></extra>"),
                  row=2, col=1)
    fig.add_trace(go.Scatter(x=xs, y=steps, name="share of steps", mode="lines", line={"color": "#555", "dash": "dot"},
                             hovertemplate="%{x} tokens: %{y:.1f}% of steps<extra></extra>"), row=2, col=1)
    for value, label, dash, y in ((per_count, "threshold per count", "dash", 1.0),
                                  (traffic_weighted, "traffic-weighted", "dot", 0.94)):
        if value is None:
            continue
        # plotly.js places a shape on a log axis at the data value but an annotation at its log10 (add_vline's label
        # would land at 10**value, off the plot): the lines and their labels are added apart
        for axis in ("x", "x2"):
            fig.add_shape(type="line", x0=value, x1=value, xref=axis, yref=f"{'y' if axis == 'x' else 'y2'} domain",
                          y0=0, y1=1, line={"color": "black", "dash": dash, "width": 1.5})
        fig.add_annotation(x=math.log10(value), xref="x", y=y, yref="paper", text=f"{label}: {describe_threshold(value)}",
                           showarrow=False, xanchor="left", yanchor="top", bgcolor="rgba(255,255,255,0.7)")
    fig.update_xaxes(type="log", title_text="tokens per step (log scale)", row=2, col=1)
    fig.update_xaxes(type="log", row=1, col=1)
    fig.update_yaxes(type="log", title_text="ms per step (log)", row=1, col=1)
    fig.update_yaxes(title_text="% of steps / time", row=2, col=1)
    fig.update_layout(title=title or f"Where the traffic's time goes ({source.upper()} rows)", height=620, width=1100)
    return fig


def latencies_figure(data: pl.DataFrame, *, source: str, title: str = "") -> go.Figure:
    """TTFT (left) and TPOT (right) per policy, bars grouped by percentile."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT, ms", "TPOT, ms"), horizontal_spacing=0.12)
    colors = {"p50": "#1f77b4", "p90": "#ff7f0e", "p99": "#d62728"}
    for col, metric in enumerate(("TTFT", "TPOT"), start=1):
        for q, color in colors.items():
            part = data.filter((pl.col("metric") == metric) & (pl.col("percentile") == q))
            fig.add_trace(go.Bar(x=part["policy"].to_list(), y=part["ms"].to_list(), name=q, marker_color=color,
                                 legendgroup=q, showlegend=col == 1,
                                 hovertemplate="%{x}: %{y:.2f} ms<extra>" + f"{metric} {q}</extra>"), row=1, col=col)
    fig.update_layout(barmode="group", height=460, width=1100,
                      title=title or f"TTFT and TPOT per policy ({source.upper()} rows)")
    fig.update_xaxes(tickangle=-30)
    return fig


# ------------------------------------------------------------------------------------------------ plot_*
def plot_step_sizes(verdict: TrafficVerdict, curves: LatencyCurves) -> go.Figure:
    """The step-size histogram under the latency curves, with both thresholds (module docstring)."""
    limit = verdict.limits.max_num_batched_tokens if verdict.limits is not None else None
    return step_sizes_figure(curves_data(curves, limit), histogram_data(verdict),
                             per_count=verdict.threshold.per_count, traffic_weighted=verdict.threshold.traffic_weighted,
                             source=verdict.source)


def plot_latencies(verdict: TrafficVerdict) -> go.Figure:
    """TTFT and TPOT at p50 / p90 / p99 per policy; ``ValueError`` for a step list (no requests)."""
    data = latencies_data(verdict)
    if data.height == 0:
        raise ValueError("a recorded step list has no requests, so no TTFT or TPOT: price a trace or a workload")
    return latencies_figure(data, source=verdict.source)


# --------------------------------------------------------------------------------------------- the report
def traffic_section_html(rows: pl.DataFrame, *, workload_name: str = "chat", requests: int = REQUESTS,
                         concurrency: int = CONCURRENCY) -> str:
    """The HTML report's "on serving traffic" section: ``workload_name`` traffic (``requests`` requests from
    ``concurrency`` users) scheduled under the report's own rows and priced per policy
    (:func:`sp_lab.serving.on_rows.rows_traffic`: one setup, measured or replayed rows before any other source,
    never mixed; the budget is the largest token count the rows cover, at most vLLM's 8192). Where the rows cannot
    price a serving step (no baseline or SP + AsyncTP curve, no row at one token) the section says so instead."""
    import html as html_lib

    from sp_lab.serving.on_rows import rows_traffic

    head = "<h2>On serving traffic</h2>"
    try:
        priced = rows_traffic(rows, workload_name, requests=requests, concurrency=concurrency)
        verdict = priced.verdict()
    except ValueError as e:
        return f"{head}<p class='warn'>Not priced on serving traffic: {html_lib.escape(str(e))}</p>"
    figure = plot_step_sizes(verdict, priced.curves).to_html(full_html=False, include_plotlyjs=False)
    return (f"{head}<p><b>[{verdict.source}]</b> {html_lib.escape(verdict.sentence)}</p>"
            f"<p>{html_lib.escape(priced.describe())} -- <code>python -m sp_lab traffic</code> prices your own "
            "traffic (docs/serving.md).</p>"
            f"<pre>{html_lib.escape(verdict.text())}</pre>{figure}")
