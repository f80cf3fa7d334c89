"""Latency vs token count for the tuner and the report: variants with intervals, a config's curve and its regret.

Layered as the rest of ``sp_lab.viz``: :func:`latency_data` turns sweep rows (a polars DataFrame,
columns in :data:`SWEEP_COLUMNS`) into plain series, threshold markers and a regret table;
:func:`build_latency_figure` draws them; :func:`plot_latency` is the thin public entry point. A live view
(the tuner) draws a fresh figure per arriving row into a :class:`~sp_lab.viz.live_figure.LiveFigure`, which
says why sp_lab does not patch a ``FigureWidget`` in place.

The regret panel and the black "config" curve are :func:`sp_lab.tuning.regret.regret_table` of the
config given (what it runs at each token count against the best variant there): the same numbers the
recommendation, the tuner's table and an exported file carry.

Drawing rules (they exist because each one hid a wrong conclusion before):

- error bars are the 95% interval of each median, described so everywhere (rows without one, e.g.
  simulated rows, get no bar rather than a different kind of bar);
- the token axis is labelled at the measured token counts, the regret axis is a percentage from 0 that
  stays readable when the regret is 0 everywhere;
- a row whose fusion did not fire (``fusion_missing``) is drawn as its own hollow-marker, dotted series
  "<variant> [fusion missing]" (:data:`FUSION_MISSING_SUFFIX`, the store's ``reported_variant`` spelling) and
  never as the variant it claims to be;
- rows a model computed (:data:`~sp_lab.vocabulary.MODELLED_SOURCES`: the performance model's predicted rows,
  and simulated ones of the retired what-if model in old stores) are dashed and labelled with their source,
  their regret line too; rehearsal rows are dash-dotted and labelled "rehearsal";
- every figure says under its title, whatever the title, where its rows come from: model, tp, device, torch,
  boundary, dtype and source (:func:`provenance_line`), so a single machine's curve still names the machine;
- replayed rows carry their provenance (device, tp, torch) in the label;
- provenance fields that differ between rows (model, device, tp, torch, boundary, dtype) are
  appended to every label so two machines' curves never share a legend entry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from sp_lab.programs import VARIANTS
from sp_lab.tuning.regret import REGRET_COLUMNS, regret_table
from sp_lab.vocabulary import (
    BASELINE,
    FUSION_MISSING_SUFFIX,
    LEGEND_COLUMNS,
    MEASURED,
    MODELLED_SOURCES,
    PREDICTED,
    REHEARSAL,
    SIMULATED,
    SP,
    SP_ASYNC_TP,
    TUNED,
)

if TYPE_CHECKING:
    from sp_lab.config import LabConfig

SWEEP_COLUMNS = ("num_tokens", "variant", "latency_us", "p10_us", "p90_us", "fusion_fired", "fusion_missing",
                 "source", "device_name", "tp", "model", "torch_version", "boundary", "dtype")
"""Columns every row to plot has (``ci_low_us`` / ``ci_high_us`` are used when present)."""
VARIANT_COLORS = {BASELINE: "#7f7f7f", SP: "#1f77b4", SP_ASYNC_TP: "#ff7f0e", TUNED: "#2ca02c"}
_EXTRA_COLORS = ("#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
_OWN_SOURCES = (MEASURED, PREDICTED, SIMULATED, REHEARSAL)  # rows made here; any other source is replayed
# Line style per source: every source a model computed is dashed (curves and regret lines alike), rehearsal rows
# (ranks sharing one GPU) dash-dotted; "dot" is left for rows whose fusion did not fire.
_DASH = {**dict.fromkeys(MODELLED_SOURCES, "dash"), REHEARSAL: "dashdot"}
_PROVENANCE_NAMES = {"model": "model", "tp": "tp", "device_name": "device", "torch_version": "torch",
                     "boundary": "boundary", "dtype": "dtype"}
_GROUP_COLUMNS = ("source", *LEGEND_COLUMNS)
CONFIG_META = "gated"
"""``meta`` of the trace drawing what the config runs at each token count (tests and the tuner find it)."""
LOG_AXIS = {"type": "log", "minorloglabels": "none", "exponentformat": "none", "separatethousands": True}
"""Every log axis sp_lab draws: labels at full values (``10,000``, not ``10k``) and none on the minor ticks, whose
default small digits ("2 3 5" between decades) read as values of their own."""
TITLE_CHARS = 90
"""The longest line a figure's title or subplot title may have: it fits a notebook's output area (about 900 px
at plotly's title font) without being cut at either end."""


@dataclass(frozen=True)
class LatencySeries:
    """One legend entry: a variant from one provenance, as points sorted by token count."""

    label: str
    """Legend text, e.g. "sp+async_tp [fusion missing]" or "sp (predicted)"."""
    variant: str
    """Variant the rows were recorded as (baseline, sp, sp+async_tp, tuned, ...)."""
    color: str
    """Line / marker colour (per variant)."""
    dash: str
    """"solid", "dash" (predicted or simulated), "dashdot" (rehearsal) or "dot" (fusion missing)."""
    hollow: bool
    """Hollow markers: the fusion this variant depends on did not fire."""
    source: str
    """Row source (measured, predicted, simulated, rehearsal, replayed)."""
    provenance: Mapping
    """model, device_name, tp, torch_version, boundary, dtype of these rows."""
    points: pl.DataFrame
    """Columns num_tokens, latency_us, err_low_us, err_high_us, n (rows pooled by median)."""


@dataclass(frozen=True)
class Threshold:
    """A vertical marker: a token count where a rule switches a pass on."""

    name: str
    """Short id ("sp", "async_tp", "vllm")."""
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
    """``group`` (legend suffix of a provenance group), ``source`` (of its rows) +
    :data:`~sp_lab.tuning.regret.REGRET_COLUMNS`: :func:`~sp_lab.tuning.regret.regret_table` of the config per
    group (empty without a config)."""
    config_name: str | None
    """The config's policy in words ("baseline below 64, sp+async_tp from 64"), ``None`` without one."""
    error_bars: str
    """What the error bars are: :data:`ERROR_BARS`, saying so when the rows carry no interval."""
    sources: tuple[str, ...]
    """Sources of the rows drawn (measured / predicted / simulated / rehearsal / replayed)."""
    provenance: str
    """:func:`provenance_line` of the rows: drawn under every title."""


def _validate(rows: pl.DataFrame | Sequence[Mapping]) -> pl.DataFrame:
    frame = rows if isinstance(rows, pl.DataFrame) else pl.DataFrame(list(rows))
    missing = [c for c in SWEEP_COLUMNS if c not in frame.columns]
    if missing and frame.height:
        raise ValueError(f"sweep rows lack columns {missing}; expected {list(SWEEP_COLUMNS)} "
                         f"(as written by sp_lab.bench.sweep)")
    if missing:  # an empty sweep before the first measurement: draw an empty figure
        frame = pl.DataFrame(schema={c: (pl.Float64 if c.endswith("_us") else pl.String) for c in SWEEP_COLUMNS}
                             ).with_columns(pl.col("num_tokens").cast(pl.Int64), pl.col("tp").cast(pl.Int64),
                                            pl.col("fusion_fired").cast(pl.Boolean),
                                            pl.col("fusion_missing").cast(pl.Boolean))
    for c in ("ci_low_us", "ci_high_us"):
        if c not in frame.columns:
            frame = frame.with_columns(pl.lit(None, dtype=pl.Float64).alias(c))
    return frame.with_columns(pl.col("fusion_missing").fill_null(False).cast(pl.Boolean),
                              pl.col("source").fill_null(MEASURED).cast(pl.String))


def provenance_line(rows: pl.DataFrame | Sequence[Mapping]) -> str:
    """Where the rows come from, in one line: model, tp, device, torch, boundary, dtype and source.

    A field the rows agree on is given ("device cpu: Xeon"), one they differ on is said to vary (each curve's
    legend entry then carries it). What every latency figure shows under its title, and the tuner beside its
    recommendation, so a number is never shown without its provenance.
    """
    frame = _validate(rows)
    if not frame.height:
        return "no rows yet"
    parts = []
    for column, name in _PROVENANCE_NAMES.items():
        values = sorted({str(v) for v in frame[column].to_list()})
        parts.append(f"{name} {values[0]}" if len(values) == 1 else f"{name}: {len(values)} values (see the legend)")
    parts.append(f"source: {', '.join(sorted(set(frame['source'].to_list())))}")
    return " · ".join(parts)


def _is_replayed(source: str) -> bool:
    return source not in _OWN_SOURCES


def _provenance_suffix(source: str, prov: Mapping, varying: Sequence[str]) -> str:
    """What tells rows of this source/provenance apart in a legend ("" for plain measured rows)."""
    label = ""
    if source in _DASH:
        label += f" ({source})"
    elif _is_replayed(source):
        label += f" [{prov['device_name']}, tp{prov['tp']}, torch {prov['torch_version']}]"
    extra = [f"{c}={prov[c]}" for c in varying
             if not (_is_replayed(source) and c in ("device_name", "tp", "torch_version"))]
    return label + (f" · {', '.join(extra)}" if extra else "")


def _thresholds(config: LabConfig | None, vllm_min_tokens: int | None) -> list[Threshold]:
    marks = []
    if config is not None and config.enable_sp and config.tp_size > 1:
        if config.enable_async_tp and config.sp_start == config.async_tp_min_tokens:
            marks.append(Threshold("async_tp", config.async_tp_min_tokens,
                                   f"async_tp_min_tokens={config.async_tp_min_tokens}", "dash"))
        else:
            marks.append(Threshold("sp", config.sp_start, f"SP from {config.sp_start}", "dash"))
            if config.enable_async_tp:
                marks.append(Threshold("async_tp", config.async_tp_min_tokens,
                                       f"AsyncTP from {config.async_tp_min_tokens}", "longdash"))
    if vllm_min_tokens is not None:
        marks.append(Threshold("vllm", int(vllm_min_tokens), f"vLLM sp_min_token_num={vllm_min_tokens}", "dot"))
    return marks


def latency_data(rows: pl.DataFrame | Sequence[Mapping], *, config: LabConfig | None = None,
                 vllm_min_tokens: int | None = None) -> LatencyData:
    """Series, threshold markers and the config's regret from sweep rows.

    Repeated rows of one series at one token count are pooled by their median. With ``config``, the
    regret panel is :func:`~sp_lab.tuning.regret.regret_table` of it, per provenance group (rows whose
    fusion did not fire never count as their variant). ``vllm_min_tokens`` is vLLM's
    ``sp_min_token_num`` for the same model and tp, drawn for reference.
    """
    frame = _validate(rows)
    own = frame.filter(pl.col("source").is_in(list(_OWN_SOURCES)))
    varying = [c for c in LEGEND_COLUMNS
               if (own if c in ("device_name", "tp", "torch_version") else frame)[c].n_unique() > 1]
    has_ci = frame.height > 0 and frame["ci_low_us"].null_count() < frame.height
    pooled = (frame.group_by(["variant", "fusion_missing", *_GROUP_COLUMNS, "num_tokens"], maintain_order=True)
              .agg(pl.col("latency_us").median(),
                   err_low_us=pl.col("ci_low_us").median(), err_high_us=pl.col("ci_high_us").median(), n=pl.len())
              .sort("num_tokens"))
    key = pl.concat_str([pl.col(c).cast(pl.String).fill_null("?") for c in _GROUP_COLUMNS], separator="|")
    pooled = pooled.with_columns(_key=key)
    suffixes = {r["_key"]: _provenance_suffix(r["source"], r, varying)
                for r in pooled.select("_key", *_GROUP_COLUMNS).unique().iter_rows(named=True)}
    pooled = pooled.with_columns(group=pl.col("_key").replace_strict(suffixes, return_dtype=pl.String))
    order = {v: i for i, v in enumerate(VARIANTS)}
    keys = pooled.select(["variant", "fusion_missing", *_GROUP_COLUMNS]).unique(maintain_order=True)
    keys = sorted(keys.iter_rows(named=True),
                  key=lambda k: (order.get(k["variant"], len(order)), k["variant"], k["fusion_missing"],
                                 k["source"] != MEASURED, str(k["source"])))
    extra_colors = iter(_EXTRA_COLORS * 4)
    colors = dict(VARIANT_COLORS)
    series = []
    for k in keys:
        if k["variant"] not in colors:
            colors[k["variant"]] = next(extra_colors)
        mask = pl.all_horizontal([(pl.col(c) == k[c]) if k[c] is not None else pl.col(c).is_null()
                                  for c in ("variant", "fusion_missing", *_GROUP_COLUMNS)])
        prov = {c: k[c] for c in LEGEND_COLUMNS}
        series.append(LatencySeries(
            label=k["variant"] + (FUSION_MISSING_SUFFIX if k["fusion_missing"] else "")
            + _provenance_suffix(k["source"], prov, varying),
            variant=k["variant"], color=colors[k["variant"]],
            dash="dot" if k["fusion_missing"] else _DASH.get(k["source"], "solid"),
            hollow=bool(k["fusion_missing"]), source=k["source"], provenance=prov,
            points=pooled.filter(mask).select("num_tokens", "latency_us", "err_low_us", "err_high_us", "n")))

    regret = _regret(frame.with_columns(_key=key), suffixes, config)
    config_name = None
    if config is not None:
        from sp_lab.tuning.policy import Policy  # the policy names live with the policies

        config_name = Policy.of(config).name + (" + per-matmul rule" if config.heuristic is not None else "")
    return LatencyData(series=tuple(series), thresholds=tuple(_thresholds(config, vllm_min_tokens)),
                       regret=regret, config_name=config_name,
                       error_bars=ERROR_BARS if has_ci else f"{ERROR_BARS} (none recorded for these rows)",
                       sources=tuple(sorted(set(frame["source"].to_list()))), provenance=provenance_line(frame))


ERROR_BARS = "95% CI of the median"
"""What every latency error bar in sp_lab is (plots, report, tuner): the 95% confidence interval of the median."""

_REGRET_SCHEMA = {"group": pl.String, "source": pl.String, "num_tokens": pl.Int64, "variant_run": pl.String,
                  "latency_us": pl.Float64, "best_variant": pl.String, "best_us": pl.Float64, "regret_rel": pl.Float64}


def _regret(frame: pl.DataFrame, suffixes: Mapping[str, str], config: LabConfig | None) -> pl.DataFrame:
    if config is None or frame.height == 0:
        return pl.DataFrame(schema=_REGRET_SCHEMA)
    parts = []
    for (k,), rows in frame.group_by("_key", maintain_order=True):
        try:
            table = regret_table(rows.drop("_key"), config, warn=False)
        except ValueError:  # this group lacks a variant the config runs: no regret to draw for it
            continue
        parts.append(table.with_columns(group=pl.lit(suffixes.get(k, "")), source=pl.lit(rows["source"][0])))
    if not parts:
        return pl.DataFrame(schema=_REGRET_SCHEMA)
    return pl.concat(parts).select(list(_REGRET_SCHEMA)).cast(_REGRET_SCHEMA).sort("group", "num_tokens")


def build_latency_figure(data: LatencyData, *, title: str | None = None) -> go.Figure:
    """Latency with intervals (top, log-log), the config's curve, and its regret (bottom, shared log x).

    ``title`` (default "Forward latency vs tokens") gets the rows' :func:`provenance_line` under it, always."""
    regret_title = ("regret of the config vs the fastest variant at each token count<br>"
                    + "<br>".join(f"<sup>{line}</sup>" for line in wrap_title(f"config: {data.config_name}"))
                    if data.config_name else "regret (no config given)")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=(0.66, 0.34), vertical_spacing=0.12,
                        subplot_titles=(f"median latency per variant; bars: {data.error_bars}", regret_title))
    for s in data.series:
        pts = s.points
        fig.add_trace(go.Scatter(
            x=pts["num_tokens"].to_list(), y=pts["latency_us"].to_list(), name=s.label, meta=f"latency:{s.label}",
            mode="lines+markers", line={"color": s.color, "dash": s.dash},
            marker={"symbol": "circle-open" if s.hollow else "circle", "size": 9 if s.hollow else 7,
                    "color": s.color, "line": {"width": 2, "color": s.color}},
            error_y={"type": "data", "symmetric": False, "thickness": 1,
                     "array": (pts["err_high_us"] - pts["latency_us"]).to_list(),
                     "arrayminus": (pts["latency_us"] - pts["err_low_us"]).to_list()},
            hovertemplate="%{x} tokens: %{y:.1f} us<extra>" + s.label + "</extra>"), row=1, col=1)
    # One config curve per provenance group: joined into one line, a replay of two machines zigzagged between them.
    groups = data.regret.group_by("group", maintain_order=True) if data.regret.height else [(("",), data.regret)]
    for (group,), curve in groups:
        fig.add_trace(go.Scatter(
            x=curve["num_tokens"].to_list(), y=curve["latency_us"].to_list(), meta=CONFIG_META,
            name=(f"config: {data.config_name}" if data.config_name else "config") + group, mode="lines",
            line={"color": "black", "width": 3}, customdata=curve["variant_run"].to_list(),
            hovertemplate="%{x} tokens: %{y:.1f} us (runs %{customdata})<extra>config</extra>"), row=1, col=1)
    for (group, source), part in data.regret.group_by(["group", "source"], maintain_order=True):
        name = f"regret{group}"
        fig.add_trace(go.Scatter(
            x=part["num_tokens"].to_list(), y=(part["regret_rel"] * 100).to_list(), name=name, meta=f"regret:{name}",
            mode="lines+markers", line={"color": "#000000", "dash": _DASH.get(source, "solid")},
            customdata=list(zip(part["variant_run"].to_list(), part["best_variant"].to_list(), strict=True)),
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
    # The measured token counts label the shared log axis (plotly's own log ticks read "2 3 4 ... 10 2 3").
    counts = sorted({int(n) for s in data.series for n in s.points["num_tokens"].to_list()})
    ticks = {"tickvals": counts, "ticktext": [str(n) for n in counts]} if counts else {}
    fig.update_xaxes(title_text="tokens per forward (log scale; ticks at the measured counts)",
                     row=2, col=1, **LOG_AXIS, **ticks)
    fig.update_xaxes(row=1, col=1, **LOG_AXIS, **ticks)
    fig.update_yaxes(title_text="latency, us (log)", row=1, col=1, **LOG_AXIS)
    # A percentage axis from 0: at least 0-5% so that "no regret anywhere" reads as a line on 0%, not as noise.
    worst = float(data.regret["regret_rel"].max() or 0.0) * 100 if data.regret.height else 0.0
    fig.update_yaxes(title_text="regret", ticksuffix="%", range=[0, max(5.0, 1.15 * worst)], row=2, col=1)
    if data.regret.height and worst == 0.0:
        fig.add_annotation(text="0% regret at every measured token count: the config runs the fastest variant",
                           xref="x2 domain", yref="y2 domain", x=0.5, y=0.6, showarrow=False, font={"size": 11})
    # No fixed width: the figure fills the notebook's output area or the report's page instead of being cut.
    # The legend sits at the bottom of the figure (``yref="container"``), where plotly.js reserves the margin it
    # needs, however many lines it wraps onto: above the plot it grew upwards over the title (a replay's or an
    # overlay's dozen entries). The title reserves its own room too (``automargin``), starting at the left edge.
    text = figure_title(title or "Forward latency vs tokens", data.provenance)
    legend_rows = _legend_rows([t.name for t in fig.data if t.name])
    fig.update_layout(title={"text": text, "yref": "container", "y": 1, "yanchor": "top", "x": 0.01,
                             "xanchor": "left", "pad": {"t": 30}},
                      height=640 + 20 * legend_rows, autosize=True,
                      legend={"groupclick": "toggleitem", "orientation": "h", "yref": "container", "yanchor": "bottom",
                              "y": 0, "xanchor": "left", "x": 0, "font": {"size": 11}},
                      # Room for every line of the title (about 22 px each) above the top panel's own title.
                      margin={"l": 70, "r": 30, "t": 40 + 22 * text.count("<br>") + 22, "b": 50})
    return fig


def _legend_rows(names: Sequence[str], width_px: int = 820) -> int:
    """About how many rows a horizontal legend of ``names`` takes in a notebook's output area: entries packed left
    to right, each about 6.5 px a character plus its line sample. The figure grows by them (20 px a row) instead
    of the plot shrinking."""
    rows, used = 1, 0.0
    for name in names:
        entry = 6.5 * len(name) + 50
        if used and used + entry > width_px:
            rows, used = rows + 1, 0.0
        used += entry
    return rows


def wrap_title(text: str, width: int = TITLE_CHARS) -> list[str]:
    """``text`` in lines of at most ``width`` characters, broken at its `` · `` separators (a longer part between
    its words): plotly does not wrap a title, and a long one is cut at both ends of a notebook's output area."""
    tokens: list[tuple[str, str]] = []  # (what joins it to the token before, the token)
    for i, part in enumerate(text.split(" · ")):
        words = part.split(" ") if len(part) > width else [part]
        tokens += [(" · " if i and j == 0 else " ", word) for j, word in enumerate(words)]
    lines: list[str] = []
    for joiner, token in tokens:
        if lines and len(lines[-1]) + len(joiner) + len(token) <= width:
            lines[-1] += joiner + token
        else:
            lines.append(token)
    return lines or [""]


def figure_title(title: str, provenance: str) -> str:
    """A figure's title with the rows' provenance under it, each line within :data:`TITLE_CHARS`."""
    return "<br>".join([*wrap_title(title), *(f"<sup>{line}</sup>" for line in wrap_title(provenance))])


def plot_latency(rows: pl.DataFrame | Sequence[Mapping], *, config: LabConfig | None = None,
                 vllm_min_tokens: int | None = None, title: str | None = None, widget: bool = False) -> go.Figure:
    """Latency vs token count per variant, the config's curve, threshold markers and its regret (module doc).

    ``widget=True`` returns a :class:`~sp_lab.viz.live_figure.LiveFigure` (needs anywidget); redraw it with a
    fresh figure (``view.show(plot_latency(more_rows))``) as rows arrive, as the tuner does.
    """
    fig = build_latency_figure(latency_data(rows, config=config, vllm_min_tokens=vllm_min_tokens), title=title)
    if widget:
        from sp_lab.viz.live_figure import LiveFigure

        return LiveFigure(fig)
    return fig


__all__ = [
    "CONFIG_META",
    "LOG_AXIS",
    "REGRET_COLUMNS",
    "SWEEP_COLUMNS",
    "LatencyData",
    "LatencySeries",
    "Threshold",
    "build_latency_figure",
    "figure_title",
    "latency_data",
    "plot_latency",
    "provenance_line",
    "wrap_title",
]
