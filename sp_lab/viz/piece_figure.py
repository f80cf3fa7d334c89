"""The piece drill-down figure: a layered DAG (laid out by ``dot``) drawn with plotly.

Three modes over one :class:`~sp_lab.viz.piece_diff.PieceDiffData`:

- ``"after"`` / ``"before"``: the whole piece graph after (before) the passes, top to bottom;
- ``"diff"``: only the rewritten neighbourhoods, each as before | after side by side, titled by what changed.

Boxes are coloured by node kind (collectives red, fused ops purple, matmuls blue, norms green); nodes the passes
added or removed have a thick black outline; ``search`` outlines matching nodes in gold. Hover shows the
members of a collapsed run, the module, shape and the source lines from the nodes' stack traces.
"""

from __future__ import annotations

from collections import defaultdict

import plotly.graph_objects as go

from sp_lab.viz.dag_layout import DagLayout, dot_layout
from sp_lab.viz.overview import ABBREVIATION_KEY, format_shape, range_title
from sp_lab.viz.piece_diff import PieceDiffData
from sp_lab.viz.piece_graph import GraphNode, PieceGraph

__all__ = ["KIND_COLORS", "MODES", "build_piece_figure"]

MODES = ("after", "before", "diff")
# (fill, outline) per node kind.
KIND_COLORS = {
    "collective": ("#f8d0d0", "#d62728"), "fused": ("#e6dcf3", "#7b4fb0"), "matmul": ("#d6e6f5", "#1f77b4"),
    "norm": ("#d9f0d3", "#2ca02c"), "split": ("#eadbd3", "#8c564b"), "input": ("#f3f3c8", "#9a9a1f"),
    "output": ("#d3f1f5", "#17a2b8"), "other": ("#eeeeee", "#8c8c8c"),
}
_SEARCH_COLOR = "#f0b400"
_GAP = 60.0  # points between the before and after columns, and between regions
_TITLE_H = 34.0
_DIFF_MAX_WIDTH = 940.0  # points (= pixels): what a JupyterLab output area shows without scrolling


def _hover(n: GraphNode) -> str:
    lines = [f"<b>{n.label}</b> ({n.kind})"]
    if n.module:
        lines.append(f"module {n.module}" + (" (inferred: the pass inserted this node)" if n.module_inferred else ""))
    lines.append(f"{format_shape(n.shape)} {n.dtype or ''}")
    if n.count > 1:
        lines.append(f"{n.count} ops: " + ", ".join(f"{m} ({o})" for m, o in zip(n.members[:12], n.ops[:12]))
                     + (" …" if n.count > 12 else ""))
    lines += [f"<span style='font-family:monospace'>{s}</span>" for s in n.sources[:4]]
    if n.reads:
        lines.append("reads " + ", ".join(n.reads[:6]) + (" …" if len(n.reads) > 6 else ""))
    if n.changed:
        lines.append("<b>changed by the passes</b>")
    return "<br>".join(lines)


class _Canvas:
    """Traces of one figure, filled graph by graph at offsets."""

    def __init__(self) -> None:
        self.edges_x: list = []
        self.edges_y: list = []
        self.boxes: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
        self.changed: tuple[list, list] = ([], [])
        self.found: tuple[list, list] = ([], [])
        self.text: dict[str, list] = {"x": [], "y": [], "text": [], "hover": [], "id": []}
        self.titles: list[tuple[float, float, str]] = []

    def draw(self, graph: PieceGraph, layout: DagLayout, dx: float, dy: float, matches: set[str]) -> None:
        nodes = {n.id: n for n in graph.nodes}
        for _, _, line in layout.edges:
            self.edges_x += [x + dx for x, _ in line] + [None]
            self.edges_y += [y + dy for _, y in line] + [None]
        for p in layout.nodes:
            n = nodes[p.id]
            x0, x1, y0, y1 = p.x - p.width / 2 + dx, p.x + p.width / 2 + dx, p.y - p.height / 2 + dy, p.y + p.height / 2 + dy
            xs, ys = [x0, x1, x1, x0, x0, None], [y0, y0, y1, y1, y0, None]
            kind = n.kind if n.kind in KIND_COLORS else "other"
            self.boxes[kind][0].extend(xs)
            self.boxes[kind][1].extend(ys)
            for flag, target in ((n.changed, self.changed), (n.id in matches, self.found)):
                if flag:
                    target[0].extend(xs)
                    target[1].extend(ys)
            self.text["x"].append(p.x + dx)
            self.text["y"].append(p.y + dy)
            self.text["text"].append(n.label)
            self.text["hover"].append(_hover(n))
            self.text["id"].append(n.id)

    def figure(self, width: float, height: float, title: str) -> go.Figure:
        fig = go.Figure()
        fig.add_trace(go.Scatter(x=self.edges_x, y=self.edges_y, mode="lines", line={"color": "#9a9a9a", "width": 1},
                                 hoverinfo="skip", showlegend=False))
        for kind, (xs, ys) in self.boxes.items():
            fill, line = KIND_COLORS[kind]
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", fill="toself", fillcolor=fill,
                                     line={"color": line, "width": 1.2}, name=kind, hoverinfo="skip"))
        for (xs, ys), name, color, w in ((self.changed, "changed by the passes", "black", 3),
                                         (self.found, "search match", _SEARCH_COLOR, 4)):
            if xs:
                fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line={"color": color, "width": w}, name=name,
                                         hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=self.text["x"], y=self.text["y"], mode="text", text=self.text["text"],
                                 hovertext=self.text["hover"], hoverinfo="text", customdata=self.text["id"],
                                 textfont={"size": 10, "family": "Arial"}, showlegend=False, name="nodes",
                                 meta="nodes"))
        annotations = [{"x": x, "y": y, "text": t, "showarrow": False, "xanchor": "left", "yanchor": "bottom",
                        "font": {"size": 12}} for x, y, t in self.titles]
        annotations.append({"text": ABBREVIATION_KEY, "xref": "paper", "yref": "paper", "x": 0, "y": 0, "yshift": -8,
                            "xanchor": "left", "yanchor": "top", "showarrow": False,
                            "font": {"size": 10, "color": "#555"}})
        px_w, px_h = max(700, width + 60), max(300, height + 180)
        fig.update_layout(
            title={"text": title, "font": {"size": 14}}, width=min(px_w, 1800), height=px_h, annotations=annotations,
            # One point of dot's layout = one pixel, so the 10 px labels fit the boxes dot sized for them.
            xaxis={"visible": False, "range": [-10, min(width, 1800 - 60) + 10]},
            yaxis={"visible": False, "range": [-10, height + 10]}, plot_bgcolor="white", dragmode="pan",
            margin={"l": 20, "r": 20, "t": 110, "b": 70}, legend={"orientation": "h", "y": 1.0, "yanchor": "bottom"},
            hoverlabel={"align": "left"})
        return fig


def _provenance(data: PieceDiffData) -> str:
    """The title's last line: where the report was compiled (backend, device, torch; or a fake process group)."""
    return f"<br><sup>{data.provenance}</sup>"


def _layout(graph: PieceGraph) -> DagLayout:
    return dot_layout(tuple((n.id, n.label) for n in graph.nodes), graph.edges)


def build_piece_figure(data: PieceDiffData, mode: str = "after", *, search: str = "") -> go.Figure:
    """Draw one piece: ``mode`` "after", "before" or "diff" (rewritten regions only); ``search`` outlines nodes
    whose op, module or FX name contains it."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; use one of {MODES}")
    counts = ", ".join(f"{r['op']} {r['before']}→{r['after']}" for r in data.op_counts.iter_rows(named=True)
                       if r["delta"]) or "no op-count changes"
    head = f"{data.piece.name} ({data.piece.kind}) · {range_title(data.range)}"
    canvas = _Canvas()
    if mode in ("after", "before"):
        graph = data.after if mode == "after" else data.before
        layout = _layout(graph)
        canvas.draw(graph, layout, 0.0, 0.0, set(graph.search(search)) if search else set())
        which = "after SP + AsyncTP" if mode == "after" else "before the passes"
        n_changed = len(data.added if mode == "after" else data.removed)
        title = (f"{head}<br><sup>{which}: {len(graph.nodes)} boxes for {sum(n.count for n in graph.nodes)} ops, "
                 f"{n_changed} ops {'added' if mode == 'after' else 'removed'} (thick outline) · {counts}</sup>"
                 f"{_provenance(data)}")
        return canvas.figure(layout.width, layout.height, title)
    return _diff_figure(data, canvas, head, counts, search)


def _diff_figure(data: PieceDiffData, canvas: _Canvas, head: str, counts: str, search: str) -> go.Figure:
    if not data.regions:
        canvas.titles.append((0.0, 0.0, "the passes did not change this piece"))
        return canvas.figure(400.0, 40.0, f"{head}<br><sup>diff: no rewritten regions</sup>{_provenance(data)}")
    laid = [(r, _layout(r.before), _layout(r.after)) for r in data.regions]
    col_w = max(lb.width for _, lb, _ in laid)
    side_by_side = col_w + _GAP + max(la.width for _, _, la in laid) <= _DIFF_MAX_WIDTH
    # Side by side when both columns fit a notebook's output width, else "after" under "before" per region.
    width = col_w + _GAP + max(la.width for _, _, la in laid) if side_by_side else max(
        col_w, max(la.width for _, _, la in laid))
    y = 0.0
    # Regions stack downwards in graph order: the first region ends up on top.
    for region, lb, la in reversed(laid):
        if side_by_side:
            h = max(lb.height, la.height)
            places = ((region.before, lb, (col_w - lb.width) / 2, y + h - lb.height),
                      (region.after, la, col_w + _GAP, y + h - la.height))
        else:
            h = lb.height + _GAP / 2 + la.height
            places = ((region.before, lb, 0.0, y + la.height + _GAP / 2), (region.after, la, 0.0, y))
            canvas.titles.append((0.0, y + la.height + 2, "<span style='color:#777'>after</span>"))
        for graph, layout, dx, dy in places:
            canvas.draw(graph, layout, dx, dy, set(graph.search(search)) if search else set())
        where = f" · {region.module.removeprefix('model.')}" if region.module else ""
        how = "(before | after)" if side_by_side else "(before, then after)"
        canvas.titles.append((0.0, y + h + 4, (f"<b>{region.index + 1}. {region.title}</b>{where}"
                                               f" <span style='color:#777'>{how}</span>")))
        y += h + _TITLE_H + _GAP / 2
    title = f"{head}<br><sup>diff: {len(data.regions)} rewritten region(s) · {counts}</sup>{_provenance(data)}"
    return canvas.figure(width, y, title)
