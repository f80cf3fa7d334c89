"""Latency vs token count for the tuner: baseline / sp / sp+async_tp / tuned, thresholds and regret.

Layered as the rest of ``sp_lab.viz``: :func:`latency_data` turns sweep rows (a polars DataFrame,
columns in :data:`SWEEP_COLUMNS`) into plain series, threshold markers and a regret table;
:func:`build_latency_figure` draws them; :func:`plot_latency` is the thin public entry point and
:func:`update_latency_figure` refreshes a live ``FigureWidget`` as new rows are measured.

Drawing rules (they exist because each one hid a wrong conclusion before, docs/thresholds.md):

- a row whose fusion did not fire (``fusion_missing``) is drawn as its own hollow-marker series
  "<variant> (fusion did not fire)" and never as the variant it claims to be;
- simulated rows (``source == "simulated"``) are dashed and labelled "simulated";
- replayed recorded rows (any source other than "measured" / "live" / "simulated") carry their
  provenance (device, tp, torch) in the label;
- provenance fields that differ between rows (model, device, tp, torch, boundary, dtype) are
  appended to every label so two machines' curves never share a legend entry.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

SWEEP_COLUMNS = ("num_tokens", "variant", "latency_us", "p10_us", "p90_us", "fusion_fired", "fusion_missing",
                 "source", "device_name", "tp", "model", "torch_version", "boundary", "dtype")
VARIANTS = ("baseline", "sp", "sp+async_tp", "tuned")
VARIANT_COLORS = {"baseline": "#7f7f7f", "sp": "#1f77b4", "sp+async_tp": "#ff7f0e", "tuned": "#2ca02c"}
_EXTRA_COLORS = ("#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
LIVE_SOURCES = ("measured", "live")
SIMULATED_SOURCE = "simulated"
# Columns that identify where a row came from; rows differing in any of these are never pooled.
PROVENANCE_COLUMNS = ("model", "device_name", "tp", "torch_version", "boundary", "dtype")
_GROUP_COLUMNS = ("source", *PROVENANCE_COLUMNS)


@dataclass(frozen=True)
class LatencySeries:
    """One legend entry: a variant from one provenance, as points sorted by token count."""

    label: str
    """Legend text, e.g. "sp+async_tp (fusion did not fire)" or "sp (simulated)"."""
    variant: str
    """Variant the rows were recorded as (baseline, sp, sp+async_tp, tuned, ...)."""
    color: str
    """Line / marker colour (per variant)."""
    dash: str
    """"solid", "dash" (simulated) or "dot" (fusion did not fire)."""
    hollow: bool
    """Hollow markers: the fusion this variant depends on did not fire."""
    source: str
    """Row source ("measured", "simulated", or a recorded source such as "recorded")."""
    provenance: Mapping
    """model, device_name, tp, torch_version, boundary, dtype of these rows."""
    points: pl.DataFrame
    """Columns num_tokens, latency_us, p10_us, p90_us, n (rows pooled by median)."""


@dataclass(frozen=True)
class Threshold:
    """A vertical marker: a token count where a rule switches a pass on."""

    name: str
    """Short id ("async_tp_min_tokens", "vllm")."""
    num_tokens: int
    """Position on the x axis."""
    label: str
    """Text drawn beside the line."""
    dash: str
    """Line style."""


@dataclass(frozen=True)
class LatencyData:
    """Everything the latency figure draws."""

    series: tuple[LatencySeries, ...]
    """Curves, in variant order."""
    thresholds: tuple[Threshold, ...]
    """Vertical markers."""
    regret: pl.DataFrame
    """Columns curve, group (legend suffix of the provenance group, "" for live rows), num_tokens,
    chosen_variant, chosen_us, best_variant, best_us, regret (chosen / best - 1; 0 means the curve
    picked the fastest variant)."""
    gate: tuple[str, str]
    """(variant below async_tp_min_tokens, variant at or above it) making up the gated curve."""


def _validate(rows: pl.DataFrame | Sequence[Mapping]) -> pl.DataFrame:
    frame = rows if isinstance(rows, pl.DataFrame) else pl.DataFrame(list(rows))
    missing = [c for c in SWEEP_COLUMNS if c not in frame.columns]
    if missing and frame.height:
        raise ValueError(f"sweep rows lack columns {missing}; expected {list(SWEEP_COLUMNS)} "
                         f"(as written by sp_lab.bench.sweep)")
    if missing:  # an empty sweep before the first measurement: draw an empty figure
        return pl.DataFrame(schema={c: (pl.Float64 if c.endswith("_us") else pl.String) for c in SWEEP_COLUMNS}
                            ).with_columns(pl.col("num_tokens").cast(pl.Int64), pl.col("tp").cast(pl.Int64),
                                           pl.col("fusion_fired").cast(pl.Boolean),
                                           pl.col("fusion_missing").cast(pl.Boolean))
    return frame.with_columns(pl.col("fusion_missing").fill_null(False).cast(pl.Boolean),
                              pl.col("source").fill_null("measured").cast(pl.String))


def _is_replayed(source: str) -> bool:
    return source not in (*LIVE_SOURCES, SIMULATED_SOURCE)


def _provenance_suffix(source: str, prov: Mapping, varying: Sequence[str]) -> str:
    """What tells rows of this source/provenance apart in a legend ("" for plain live rows)."""
    label = ""
    if source == SIMULATED_SOURCE:
        label += " (simulated)"
    elif _is_replayed(source):
        label += f" [{prov['device_name']}, tp{prov['tp']}, torch {prov['torch_version']}]"
    extra = [f"{c}={prov[c]}" for c in varying
             if not (_is_replayed(source) and c in ("device_name", "tp", "torch_version"))]
    return label + (f" · {', '.join(extra)}" if extra else "")


def latency_data(rows: pl.DataFrame | Sequence[Mapping], *, async_tp_min_tokens: int | None = None,
                 vllm_min_tokens: int | None = None, gate: tuple[str, str] = ("sp", "sp+async_tp"),
                 regret_variants: Iterable[str] = ("tuned",)) -> LatencyData:
    """Series, threshold markers and regret from sweep rows.

    Repeated rows of one series at one token count are pooled by their median. The gated curve
    runs ``gate[0]`` below ``async_tp_min_tokens`` and ``gate[1]`` from it on; its regret (and that
    of each variant in ``regret_variants`` present) is latency / fastest variant at that token
    count - 1, per provenance group, over rows whose fusion fired as recorded (rows with
    ``fusion_missing`` are not the variant they name, so they are never "best" nor "chosen").
    ``vllm_min_tokens`` is vLLM's ``sp_min_token_num`` for the same model and tp
    (``MB * tp * 2**20 // (hidden * bytes)``), drawn for reference.
    """
    frame = _validate(rows)
    # Replayed rows name their device/tp/torch anyway, so those only count as "varying" among the rest.
    own = frame.filter(pl.col("source").is_in([*LIVE_SOURCES, SIMULATED_SOURCE]))
    varying = [c for c in PROVENANCE_COLUMNS
               if (own if c in ("device_name", "tp", "torch_version") else frame)[c].n_unique() > 1]
    pooled = (frame.group_by(["variant", "fusion_missing", *_GROUP_COLUMNS, "num_tokens"], maintain_order=True)
              .agg(pl.col("latency_us").median(), pl.col("p10_us").median(), pl.col("p90_us").median(),
                   n=pl.len())
              .sort("num_tokens"))
    # "group": the legend suffix of a provenance group; regret is computed within each group.
    key = pl.concat_str([pl.col(c).cast(pl.String).fill_null("?") for c in _GROUP_COLUMNS], separator="|")
    pooled = pooled.with_columns(_key=key)
    suffixes = {r["_key"]: _provenance_suffix(r["source"], r, varying)
                for r in pooled.select("_key", *_GROUP_COLUMNS).unique().iter_rows(named=True)}
    pooled = pooled.with_columns(group=pl.col("_key").replace_strict(suffixes, return_dtype=pl.String)
                                 ).drop("_key")
    order = {v: i for i, v in enumerate(VARIANTS)}
    keys = pooled.select(["variant", "fusion_missing", *_GROUP_COLUMNS]).unique(maintain_order=True)
    keys = sorted(keys.iter_rows(named=True),
                  key=lambda k: (order.get(k["variant"], len(order)), k["variant"], k["fusion_missing"],
                                 k["source"] == SIMULATED_SOURCE, str(k["source"])))
    extra_colors = iter(_EXTRA_COLORS * 4)
    colors = dict(VARIANT_COLORS)
    series = []
    for key in keys:
        if key["variant"] not in colors:
            colors[key["variant"]] = next(extra_colors)
        mask = pl.all_horizontal([(pl.col(c) == key[c]) if key[c] is not None else pl.col(c).is_null()
                                  for c in ("variant", "fusion_missing", *_GROUP_COLUMNS)])
        prov = {c: key[c] for c in PROVENANCE_COLUMNS}
        simulated = key["source"] == SIMULATED_SOURCE
        series.append(LatencySeries(
            label=(f"{key['variant']} (fusion did not fire)" if key["fusion_missing"] else key["variant"])
            + _provenance_suffix(key["source"], prov, varying),
            variant=key["variant"], color=colors[key["variant"]],
            dash="dash" if simulated else ("dot" if key["fusion_missing"] else "solid"),
            hollow=bool(key["fusion_missing"]), source=key["source"], provenance=prov,
            points=pooled.filter(mask).select("num_tokens", "latency_us", "p10_us", "p90_us", "n")))

    thresholds = []
    if async_tp_min_tokens is not None:
        thresholds.append(Threshold("async_tp_min_tokens", int(async_tp_min_tokens),
                                    f"async_tp_min_tokens={async_tp_min_tokens}", "dash"))
    if vllm_min_tokens is not None:
        thresholds.append(Threshold("vllm", int(vllm_min_tokens), f"vLLM sp_min_token_num={vllm_min_tokens}", "dot"))
    regret = _regret(pooled, async_tp_min_tokens, gate, tuple(regret_variants))
    return LatencyData(series=tuple(series), thresholds=tuple(thresholds), regret=regret, gate=gate)


_REGRET_SCHEMA = {"curve": pl.String, "group": pl.String, "num_tokens": pl.Int64, "chosen_variant": pl.String,
                  "chosen_us": pl.Float64, "best_variant": pl.String, "best_us": pl.Float64, "regret": pl.Float64}


def _regret(pooled: pl.DataFrame, threshold: int | None, gate: tuple[str, str],
            extra: tuple[str, ...]) -> pl.DataFrame:
    valid = pooled.filter(~pl.col("fusion_missing"))
    if not valid.height:
        return pl.DataFrame(schema=_REGRET_SCHEMA)
    best = (valid.sort("latency_us").group_by(["group", "num_tokens"], maintain_order=True)
            .agg(best_variant=pl.col("variant").first(), best_us=pl.col("latency_us").first()))
    curves = []
    if threshold is not None:
        chosen = pl.when(pl.col("num_tokens") >= threshold).then(pl.lit(gate[1])).otherwise(pl.lit(gate[0]))
        curves.append(("gated", valid.filter(pl.col("variant") == chosen)))
    curves += [(v, valid.filter(pl.col("variant") == v)) for v in extra if v not in gate]
    frames = [c.select("group", "num_tokens", chosen_variant="variant", chosen_us="latency_us")
              .join(best, on=["group", "num_tokens"]).with_columns(curve=pl.lit(name),
                                                                   regret=pl.col("chosen_us") / pl.col("best_us") - 1)
              for name, c in curves if c.height]
    if not frames:
        return pl.DataFrame(schema=_REGRET_SCHEMA)
    return pl.concat(frames).select(list(_REGRET_SCHEMA)).cast(_REGRET_SCHEMA).sort("curve", "group", "num_tokens")


def build_latency_figure(data: LatencyData, *, title: str | None = None) -> go.Figure:
    """Latency (top, log-log) and regret of the gated curve (bottom, shared log x) with threshold lines."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=(0.7, 0.3), vertical_spacing=0.06,
                        subplot_titles=("latency", (f"regret vs best variant (gated: {data.gate[0]} below "
                                                   f"async_tp_min_tokens, {data.gate[1]} above)")))
    for s in data.series:
        pts = s.points
        fig.add_trace(go.Scatter(
            x=pts["num_tokens"].to_list(), y=pts["latency_us"].to_list(), name=s.label, meta=f"latency:{s.label}",
            mode="lines+markers", line={"color": s.color, "dash": s.dash},
            marker={"symbol": "circle-open" if s.hollow else "circle", "size": 9 if s.hollow else 7,
                    "color": s.color, "line": {"width": 2, "color": s.color}},
            error_y={"type": "data", "symmetric": False, "thickness": 1,
                     "array": (pts["p90_us"] - pts["latency_us"]).to_list(),
                     "arrayminus": (pts["latency_us"] - pts["p10_us"]).to_list()},
            hovertemplate="%{x} tokens: %{y:.1f} us<extra>" + s.label + "</extra>"), row=1, col=1)
    for (curve, group), part in data.regret.group_by(["curve", "group"], maintain_order=True):
        name = f"regret: {curve}{group}"
        color = "#000000" if curve == "gated" else VARIANT_COLORS.get(curve, "#9467bd")
        fig.add_trace(go.Scatter(
            x=part["num_tokens"].to_list(), y=(part["regret"] * 100).to_list(), name=name, meta=f"regret:{name}",
            mode="lines+markers", line={"color": color, "dash": "dash" if "(simulated)" in group
                                        else "solid"},
            customdata=list(zip(part["chosen_variant"].to_list(), part["best_variant"].to_list())),
            hovertemplate="%{x} tokens: +%{y:.1f}% (ran %{customdata[0]}, best %{customdata[1]})<extra></extra>"),
            row=2, col=1)
    # Shapes on a log axis take data coordinates but annotations take log10 of them (plotly's rule);
    # labels are staggered so two nearby thresholds stay readable.
    for k, t in enumerate(data.thresholds):
        fig.add_shape(type="line", x0=t.num_tokens, x1=t.num_tokens, y0=0, y1=1, xref="x", yref="paper",
                      line={"color": "#444", "dash": t.dash, "width": 1.5})
        fig.add_annotation(x=math.log10(t.num_tokens), xref="x", y=0.98 - 0.07 * k, yref="y domain",
                           text=t.label, showarrow=False, xanchor="left", xshift=4, font={"size": 10},
                           bgcolor="rgba(255,255,255,0.7)")
    fig.update_xaxes(type="log", title_text="tokens per forward (log)", row=2, col=1)
    fig.update_xaxes(type="log", row=1, col=1)
    fig.update_yaxes(type="log", title_text="latency (us, p10-p90 bars)", row=1, col=1)
    fig.update_yaxes(title_text="regret (%)", rangemode="tozero", row=2, col=1)
    fig.update_layout(title=title or "latency vs token count", height=720, width=1100,
                      legend={"groupclick": "toggleitem"}, margin={"l": 60, "r": 20, "t": 70, "b": 50})
    return fig


def plot_latency(rows: pl.DataFrame | Sequence[Mapping], *, async_tp_min_tokens: int | None = None,
                 vllm_min_tokens: int | None = None, gate: tuple[str, str] = ("sp", "sp+async_tp"),
                 regret_variants: Iterable[str] = ("tuned",), title: str | None = None,
                 widget: bool = False) -> go.Figure:
    """Latency vs token count per variant, threshold markers and a regret subplot (see module doc).

    ``widget=True`` returns a ``go.FigureWidget`` (needs anywidget) that
    :func:`update_latency_figure` can refresh as rows arrive.
    """
    fig = build_latency_figure(latency_data(rows, async_tp_min_tokens=async_tp_min_tokens,
                                            vllm_min_tokens=vllm_min_tokens, gate=gate,
                                            regret_variants=regret_variants), title=title)
    if widget:
        try:
            import anywidget  # noqa: F401  (plotly's FigureWidget is built on it)
        except ImportError as err:
            raise ImportError("widget=True needs anywidget (pip install anywidget)") from err
        return go.FigureWidget(fig)
    return fig


def update_latency_figure(fig: go.Figure, rows: pl.DataFrame | Sequence[Mapping], **kwargs) -> go.Figure:
    """Refresh ``fig`` in place from all rows so far: points appear as they are measured.

    Existing traces (matched by their ``meta`` key; FigureWidget rewrites ``uid``) get new data inside ``batch_update`` (one message to the
    browser for a ``FigureWidget``); series seen for the first time are appended; thresholds are
    redrawn. ``kwargs`` are those of :func:`plot_latency` (except ``widget``).
    """
    title = kwargs.pop("title", None)
    fresh = build_latency_figure(latency_data(rows, **kwargs), title=title)
    by_key = {t.meta: t for t in fig.data if isinstance(t.meta, str)}
    new = []
    with fig.batch_update():
        for trace in fresh.data:
            old = by_key.get(trace.meta)
            if old is None:
                new.append(trace)
                continue
            old.update(x=trace.x, y=trace.y, error_y=trace.error_y, customdata=trace.customdata)
        fig.layout.shapes = fresh.layout.shapes
        # Subplot titles are annotations too; the fresh figure carries both them and the threshold labels.
        fig.layout.annotations = fresh.layout.annotations
        fig.layout.title = fresh.layout.title
    if new:  # plotly refuses add_traces inside batch_update
        fig.add_traces(new, rows=[1 if t.meta.startswith("latency:") else 2 for t in new], cols=[1] * len(new))
    return fig


__all__ = [
    "SWEEP_COLUMNS",
    "VARIANTS",
    "LatencyData",
    "LatencySeries",
    "Threshold",
    "build_latency_figure",
    "latency_data",
    "plot_latency",
    "update_latency_figure",
]
