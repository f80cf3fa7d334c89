"""Predicted curves beside measured ones: dashed, in their own legend group, labelled "predicted".

They are drawn, never scored: nothing here feeds a regret, a recommendation or an export (those read the
measured rows only). Used by the tuner's overlay (:meth:`sp_lab.widgets.tuner.TunerState.overlay_prediction`)
and by the report's "what this would be on 8x H200" section.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

import plotly.graph_objects as go
import polars as pl

from sp_lab.programs import REFERENCE_VARIANTS
from sp_lab.resources import preset_names
from sp_lab.viz.latency import LOG_AXIS, VARIANT_COLORS
from sp_lab.vocabulary import PREDICTED

if TYPE_CHECKING:
    from sp_lab.tuning.predict.advice import Prediction

PREDICTED_GROUP = "predicted"
"""Legend group (and trace ``meta`` prefix) of every predicted curve."""
REPORT_GPU = "h200"
"""The GPU the report's predicted section is for."""
REPORT_MODEL = "llama-3-70b"
"""The preset the report predicts when the swept model is not one (e.g. ``toy``)."""


def add_predicted_curves(fig: go.Figure, rows: pl.DataFrame, *, subplot: bool = True) -> go.Figure:
    """Add one dashed curve per variant of ``rows`` (all ``source="predicted"``) to ``fig``'s latency panel.

    ``subplot``: ``fig`` is the tuner's two-panel latency figure (curves go to its top panel).
    """
    if not rows.height:
        return fig
    if set(rows["source"].unique().to_list()) != {PREDICTED}:
        raise ValueError(f"predicted curves need source={PREDICTED!r} rows only; got {sorted(rows['source'].unique())}")
    r0 = rows.row(0, named=True)
    title = f"predicted: {r0['model']}, {r0['device_name'].removeprefix('predicted: ')}"
    drawn = [v for v in REFERENCE_VARIANTS if v in set(rows["variant"].to_list())]
    for variant in drawn:
        pts = rows.filter(pl.col("variant") == variant).sort("num_tokens")
        trace = go.Scatter(
            x=pts["num_tokens"].to_list(), y=pts["latency_us"].to_list(), name=f"{variant} (predicted)",
            meta=f"{PREDICTED_GROUP}:{variant}", mode="lines+markers", legendgroup=PREDICTED_GROUP,
            legendgrouptitle_text=title, line={"color": VARIANT_COLORS.get(variant, "#444"), "dash": "dash"},
            marker={"symbol": "diamond-open", "size": 8}, opacity=0.85,
            hovertemplate="%{x} tokens: %{y:.1f} us<extra>" + variant + " (predicted)</extra>")
        if subplot:
            fig.add_trace(trace, row=1, col=1)
        else:
            fig.add_trace(trace)
    if subplot and fig.layout.height:  # the legend's rows below the plot: a row for the group, one per curve
        fig.update_layout(height=fig.layout.height + 20 * (1 + len(drawn)))
    return fig


def report_setup(model: str) -> tuple[str, int]:
    """The preset and tp the report predicts for: the swept model if it is a preset, else
    :data:`REPORT_MODEL`; tp 8, or the largest of 4 / 2 the preset's heads and MLP divide by."""
    from sp_lab.tuning.microbench import _spec_dims

    preset = model if model in preset_names() else REPORT_MODEL
    dims = _spec_dims(preset)
    tp = next(t for t in (8, 4, 2) if dims["num_heads"] % t == 0 and dims["intermediate_size"] % t == 0)
    return preset, tp


def predicted_section_html(model: str, *, include_plotlyjs: bool | str = False) -> str:
    """The report's "what this would be on 8x H200" section for the swept ``model`` (see :func:`report_setup`)."""
    from sp_lab.tuning.predict.advice import predict

    preset, tp = report_setup(model)
    p: Prediction = predict(preset, tp, REPORT_GPU)
    fig = add_predicted_curves(go.Figure(), p.rows, subplot=False)
    fig.update_xaxes(title_text="tokens per forward (log scale)", **LOG_AXIS)
    fig.update_yaxes(title_text="predicted latency, us (log)", **LOG_AXIS)
    fig.update_layout(title=f"PREDICTED, not measured: {preset}, {tp}x {p.target.gpu.label}", height=420, width=1100)
    why = "" if preset == model else (f" The swept model <code>{html.escape(model)}</code> is not a preset, so this "
                                      f"shows <code>{preset}</code>.")
    config = ", ".join(f"{k}={v}" for k, v in p.config_summary().items())
    return "\n".join([
        f"<h2>What this would be on {tp}x H200 (predicted)</h2>",
        (f"<p class='warn'>Everything in this section is <b>predicted</b> (source: predicted) by sp_lab's "
        f"performance model; no multi-GPU run happened here.{why} Its terms: {html.escape(p.target.provenance())}. "
        "Model and its validation: docs/predictions.md.</p>"),
        fig.to_html(full_html=False, include_plotlyjs=include_plotlyjs),
        (f"<p>Predicted crossover sp+async_tp over baseline: {html.escape(p.async_tp.describe())}; sp over baseline: "
        f"{html.escape(p.sp.describe())}.</p>"),
        (f"<p>Predicted config (source: predicted): <code>{html.escape(config)}</code>. Not exported: "
        "<code>python -m sp_lab predict --export-predicted DIR</code> writes it on purpose.</p>"),
    ])
