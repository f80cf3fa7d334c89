"""The overview figure: a lane of piece boxes left to right, what crosses each boundary written under it.

Each compiled piece says what it runs (``1 RS · 1 AG+mm · 1 mm+RS``), its compile time and whether a cache
served it; each boundary its bytes per token (total, sharded, full) and each tensor's shape. Failed checks are
red, erased copies orange. Every clickable text carries ``customdata`` (``"piece:2"``, ``"group:g0"``,
``"tensor:1:3"`` = boundary 1, tensor 3) which the explorer widget turns into a drill-down.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import plotly.graph_objects as go

from sp_lab.compiler.shape_text import format_symbols
from sp_lab.viz.overview import (
    ABBREVIATION_KEY,
    BoundaryLabel,
    OverviewData,
    PieceBox,
    PieceGroup,
    crossing_text,
    format_shape,
    range_title,
)

__all__ = ["FAILURE_COLOR", "FULL_COLOR", "SHARDED_COLOR", "UNSAFE_COLOR", "build_overview_figure"]

SHARDED_COLOR = "#6a3d9a"
FULL_COLOR = "#4d4d4d"
FAILURE_COLOR = "#d62728"
UNSAFE_COLOR = "#e6780b"
_BOX_FILL = {"compiled": "#dbe9f6", "splitting_op": "#f3e3c9", "group": "#e4ecd9"}
_BOX_LINE = {"compiled": "#3b6ea5", "splitting_op": "#b07b2a", "group": "#5b8a3c"}

# Lane geometry in x units (about _PX_PER_UNIT px each) sized so 10 px labels of neighbours do not collide.
_PIECE_W, _SPLIT_W, _SPLIT_BOX_W, _GROUP_W, _GAP_W, _LINK_W = 1.9, 3.4, 1.3, 4.0, 3.6, 0.5
_LINE_H, _PX_PER_UNIT, _MAX_WIDTH_PX = 0.22, 70, 1600


def _rect(x0: float, x1: float, y0: float, y1: float) -> tuple[list, list]:
    return [x0, x1, x1, x0, x0, None], [y0, y0, y1, y1, y0, None]


def _piece_hover(p: PieceBox) -> str:
    colls = ", ".join(f"{k} {v}" for k, v in p.ops_after.items() if v) or "no collectives or matmuls"
    matches = ", ".join(f"{k} {v}" for k, v in p.matches.items() if v) or "no pass matches"
    t = "n/a" if p.compile_time_s is None else f"{p.compile_time_s:.2f} s"
    return (f"<b>{p.name}</b> ({p.kind}{', ' + p.op if p.op else ''})<br>compile {t}; served by an identical "
            f"piece: {p.cache_hit}; Inductor cache hit: {p.inductor_cache_hit}<br>after passes: {colls}"
            f"<br>matches: {matches}<br>nodes added by passes: {p.n_changed}<br><i>click to open</i>")


def _piece_label(p: PieceBox) -> str:
    ops = p.ops_text.split(" · ")
    # Two op counts per line keep the box narrow enough for an 80-layer lane.
    lines = [f"<b>{p.short_label}</b>", *(" · ".join(ops[i:i + 2]) for i in range(0, len(ops), 2)), p.compile_text]
    return "<br>".join(line for line in lines if line)


class _Texts:
    """One text trace's points, filled as the lane is laid out."""

    def __init__(self) -> None:
        self.x: list[float] = []
        self.y: list[float] = []
        self.text: list[str] = []
        self.hover: list[str] = []
        self.key: list[str] = []

    def add(self, x: float, y: float, text: str, hover: str, key: str = "") -> None:
        self.x.append(x)
        self.y.append(y)
        self.text.append(text)
        self.hover.append(hover)
        self.key.append(key)

    def trace(self, **kwargs) -> go.Scatter:
        return go.Scatter(x=self.x, y=self.y, mode="text", text=self.text, hovertext=self.hover, hoverinfo="text",
                          customdata=self.key, **kwargs)


def build_overview_figure(data: OverviewData, expand: bool | Iterable[str] = False) -> go.Figure:
    """Horizontal lane of piece boxes with boundary labels between them (see the module docstring).

    Three steps: lay the lane out left to right (:class:`_LaneDrawing`), turn what was laid out into traces,
    then title and size the figure.
    """
    drawing = _LaneDrawing(data)
    lane = data.lane(expand)
    for k, item in enumerate(lane):
        if isinstance(item, PieceGroup):
            drawing.add_group(item)
        else:
            drawing.add_piece(item)
        if k < len(lane) - 1:
            drawing.add_gap_after(item)
    if not data.pieces and data.failures:
        drawing.add_failed_compile()
    fig = go.Figure(drawing.traces())
    fig.add_annotation(text=ABBREVIATION_KEY, xref="paper", yref="paper", x=0, y=0, yshift=-8, xanchor="left",
                       yanchor="top", showarrow=False, font={"size": 10, "color": "#555"})
    fig.update_layout(
        # Long (expanded) lanes open at a readable zoom on their left end; pan to see the rest.
        title={"text": _title(data), "font": {"size": 14}}, height=340 + int(-drawing.deepest / _LINE_H) * 16,
        width=min(max(900, int(drawing.x * _PX_PER_UNIT)), _MAX_WIDTH_PX),
        xaxis={"visible": False, "range": [-0.3, min(drawing.x + 0.5, _MAX_WIDTH_PX / _PX_PER_UNIT)]},
        yaxis={"visible": False, "range": [drawing.deepest - 0.2, 1.6]},
        plot_bgcolor="white", dragmode="pan", margin={"l": 20, "r": 20, "t": 85, "b": 70},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.0, "x": 0},
    )
    return fig


class _LaneDrawing:
    """The lane as it is laid out: box outlines per style, text points per kind, the x reached, the lowest label."""

    def __init__(self, data: OverviewData) -> None:
        self.data = data
        self.erased_at: dict[int, int] = defaultdict(int)
        for e in data.erased:
            self.erased_at[e.piece] += 1
        self.failing_pieces = {f.piece for f in data.failures}
        self.boxes: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
        self.labels, self.fails, self.unsafe = _Texts(), _Texts(), _Texts()
        self.tensors = {"full": _Texts(), "sharded": _Texts(), "bytes": _Texts()}
        self.links_x: list = []
        self.links_y: list = []
        self.deepest = 0.0
        self.x = 0.0

    def _box(self, style: str, x0: float, x1: float, y0: float = 0.0, y1: float = 1.0) -> None:
        bx, by = _rect(x0, x1, y0, y1)
        self.boxes[style][0].extend(bx)
        self.boxes[style][1].extend(by)

    def _link(self, x0: float, x1: float) -> None:
        self.links_x += [x0, x1, None]
        self.links_y += [0.5, 0.5, None]

    def put_tensors(self, x: float, boundary: BoundaryLabel, y0: float, prefix: str = "") -> float:
        """Write what crosses ``boundary`` from ``y0`` down at ``x``; returns the y below the last line."""
        y = y0
        # The compiler records hand-overs compiled -> compiled across the eager op between them; say so only
        # when a hand-over skips more than that one op.
        route = (f"<i>piece {boundary.after_piece} → piece {boundary.before_piece}</i> · "
                 if boundary.before_piece > boundary.after_piece + 2 else "")
        where = f"boundary {boundary.index}: piece {boundary.after_piece} → {boundary.before_piece}"
        self.tensors["bytes"].add(x, y, f"{prefix}{route}<b>{boundary.text}</b>", f"{where}<br>" + "<br>".join(
            f"{t.name}: {t.bytes_per_token_after or 0:g} bytes/token ({'sharded' if t.sharded_after else 'full'})"
            for t in boundary.tensors))
        y -= _LINE_H
        for i, t in enumerate(boundary.tensors):
            self.tensors["sharded" if t.sharded_after else "full"].add(
                x, y, prefix + crossing_text(t),
                f"{where}<br><b>{t.name}</b> {t.dtype}{'<br>made in ' + t.module if t.module else ''}"
                f"{'<br>' + t.source if t.source else ''}<br>before passes "
                f"{format_shape(t.shape_before)}{' sharded' if t.sharded_before else ''}<br>after passes "
                f"{format_shape(t.shape_after)}{' sharded' if t.sharded_after else ''}<br>"
                f"{t.bytes_per_token_after or 0:g} bytes/token on this rank<br><i>click for producers and consumers</i>",
                key=f"tensor:{boundary.index}:{i}")
            y -= _LINE_H
        for f in boundary.failures:
            self.fails.add(x, y, f"<b>{f.text}</b>", f"{f.check} on {f.tensor}<br>{format_symbols(f.message)}")
            y -= 3 * _LINE_H  # the failure label has three lines (check, expected, got)
        self.deepest = min(self.deepest, y)
        return y

    def add_group(self, group: PieceGroup) -> None:
        """Identical layers collapsed into one stacked box, with every boundary inside the block written under it."""
        x, w, data = self.x, _GROUP_W, self.data
        for off in (0.16, 0.08):  # a stacked look says "many of these" without drawing them all
            self._box("group_shadow", x + off, x + w + off, off, 1 + off)
        block = [data.piece(i) for i in group.block]
        kinds = " + ".join(p.op.split("::")[-1] if p.op else "compiled" for p in block)
        ops = "<br>".join(p.ops_text for p in block if p.ops_text)
        self.labels.add(x + w / 2, 0.5, f"<b>{group.label}</b><br>{kinds}<br>{ops}<br>[{group.id}]",
                        f"<b>{group.label}</b> ({group.id}): {group.repeats} identical blocks of {group.period} "
                        "pieces<br>" + "<br>".join(_piece_hover(p) for p in block), key=f"group:{group.id}")
        y = -0.3
        for p in block:  # with two or more repeats every boundary of the block is also inside the group
            inner = data.boundary_after(p.index)
            if inner is not None:
                y = self.put_tensors(x + w / 2, inner, y, prefix="↳ ")
        n_erased = sum(self.erased_at[i] for i in group.pieces)
        if n_erased:
            self.unsafe.add(x + w / 2, 1.35, f"⚠ unsafe: copy_ erased x{n_erased}",
                            "gather_erase dropped these residual writes; later pieces read stale data")
        self._box("failed" if self.failing_pieces.intersection(group.pieces) else "group", x, x + w)
        self.x += w

    def add_piece(self, piece: PieceBox) -> None:
        """One compiled piece or eager splitting op; under an eager op, what the pieces around it hand over."""
        x, data = self.x, self.data
        w = _PIECE_W if piece.kind == "compiled" else _SPLIT_W
        style = piece.kind if piece.kind in _BOX_FILL else "compiled"
        self.labels.add(x + w / 2, 0.5, _piece_label(piece), _piece_hover(piece), key=f"piece:{piece.index}")
        if self.erased_at[piece.index]:
            self.unsafe.add(x + w / 2, 1.35, "⚠ unsafe: copy_ erased", "<br>".join(
                f"copy_ into {e.target} {format_shape(e.dst_shape)} from {format_shape(e.src_shape)} erased"
                for e in data.erased if e.piece == piece.index))
        # The compiler records the hand-over compiled -> compiled across the eager op between them: what
        # crosses is written under that op.
        crossing = data.boundary_after(piece.index - 1) if piece.kind == "splitting_op" else None
        if crossing is not None and crossing.before_piece > piece.index:
            self.put_tensors(x + w / 2, crossing, -0.3)
        # A splitting op's column is wide for the tensor labels under it; its box stays narrow.
        inset = (w - _SPLIT_BOX_W) / 2 if style == "splitting_op" else 0.0
        if inset:
            self._link(x, x + inset)
            self._link(x + w - inset, x + w)
        self._box("failed" if piece.index in self.failing_pieces else style, x + inset, x + w - inset)
        self.x += w

    def add_gap_after(self, item: PieceBox | PieceGroup) -> None:
        """The link to the next item: wide, with the crossing tensors, where two compiled pieces hand over directly."""
        direct = (self.data.boundary_after(item.index) if isinstance(item, PieceBox) and item.kind == "compiled"
                  else None)
        gap = _GAP_W if direct is not None and direct.before_piece == item.index + 1 else _LINK_W
        self._link(self.x, self.x + gap)
        if gap == _GAP_W:
            self.put_tensors(self.x + gap / 2, direct, -0.3)
        self.x += gap

    def add_failed_compile(self) -> None:
        """A compile that failed leaves no pieces: its failures in red, where the lane would be."""
        w = _GROUP_W * 1.5
        self._box("failed", 0.0, w)
        self.labels.add(w / 2, 0.5, "<b>compile failed</b><br>no pieces were built", "the range did not compile")
        y = -0.3
        for f in self.data.failures:
            self.fails.add(w / 2, y, f"<b>{f.text}</b><br>on {f.tensor}",
                           f"{f.check} on {f.tensor}<br>{format_symbols(f.message)}")
            y -= 4 * _LINE_H
        self.deepest, self.x = y, w

    def traces(self) -> list[go.Scatter]:
        """Links, boxes by style (with their legend entries), then the text layers the explorer clicks on."""
        out = [go.Scatter(x=self.links_x, y=self.links_y, mode="lines", line={"color": "#999", "width": 1.5},
                          hoverinfo="skip", showlegend=False)]
        box_style = {"group_shadow": ("#f4f7ef", "#9fb98b", None),
                     "compiled": (_BOX_FILL["compiled"], _BOX_LINE["compiled"], "compiled piece"),
                     "splitting_op": (_BOX_FILL["splitting_op"], _BOX_LINE["splitting_op"], "splitting op (eager)"),
                     "group": (_BOX_FILL["group"], _BOX_LINE["group"], "identical layers (collapsed)"),
                     "failed": ("#f9d6d5", FAILURE_COLOR, "failed check")}
        for key, (fill, line, name) in box_style.items():
            if key in self.boxes:
                out.append(go.Scatter(x=self.boxes[key][0], y=self.boxes[key][1], fill="toself", fillcolor=fill,
                                      mode="lines", line={"color": line, "width": 3 if key == "failed" else 1.5},
                                      name=name, showlegend=name is not None, hoverinfo="skip"))
        out.append(self.labels.trace(textfont={"size": 10}, showlegend=False, name="pieces", meta="pieces"))
        out.append(self.tensors["bytes"].trace(textfont={"color": FULL_COLOR, "size": 10}, showlegend=False,
                                               name="bytes per token", meta="bytes"))
        for key, color, name in (("full", FULL_COLOR, "full tensor"), ("sharded", SHARDED_COLOR, "sharded tensor")):
            out.append(self.tensors[key].trace(textfont={"color": color, "size": 10}, name=name,
                                               showlegend=bool(self.tensors[key].x), meta="tensors"))
        if self.fails.x:
            out.append(self.fails.trace(name="failed check", textposition="bottom center", showlegend=False,
                                        textfont={"color": FAILURE_COLOR, "size": 10}, meta="failures"))
        if self.unsafe.x:
            out.append(self.unsafe.trace(name="unsafe: copy_ erased", textfont={"color": UNSAFE_COLOR, "size": 11},
                                         meta="unsafe"))
        return out


def _title(data: OverviewData) -> str:
    """Model, tp and range, then what went wrong in it (unsafe, failed checks, not compiled); under it where the
    report was compiled (backend, device, torch: "fake process group: graphs only" for a fake group)."""
    title = f"{data.model} tp{data.tp_size} · {range_title(data.range)}"
    if data.range.numerically_unsafe:
        title += f" · <span style='color:{UNSAFE_COLOR}'>NUMERICALLY UNSAFE</span>"
    if data.failures:
        title += f" · <span style='color:{FAILURE_COLOR}'>{len(data.failures)} failed check(s)</span>"
    if not data.pieces and not data.failures:
        title += " · not compiled yet (ranges compile on their first token count)"
    elif not data.range.compiled:
        title += f" · <span style='color:{FAILURE_COLOR}'>compile failed</span>"
    if data.synthetic:
        title += " · (synthetic report)"
    return f"{title}<br><sup>{data.provenance}</sup>"
