"""A notebook front end for the split-graph explorer: click a piece to open it, click a tensor to follow it.

The overview and the drill-down are :class:`~sp_lab.viz.live_figure.LiveFigure`s (drawn by every view, whenever
it is created, and redrawn in place): clicking a piece (or a collapsed group) in the overview opens its drill-down
below; clicking a tensor under a boundary lists its
producers and consumers in both pieces. Controls: the compile range, one toggle per collapsed group, the piece,
the drill-down mode (after / before / diff) and a search box (op or module name). The widget holds no logic of its
own beyond wiring these to the data and figure functions of ``sp_lab.viz``.

    from sp_lab.widgets.explorer import explore
    explore(compiled.report)            # or a path to a saved report
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

import ipywidgets as widgets
import plotly.graph_objects as go

from sp_lab.viz.live_figure import ClickedPoint, LiveFigure
from sp_lab.viz.overview import OverviewData, overview_data
from sp_lab.viz.overview_figure import build_overview_figure
from sp_lab.viz.piece_diff import piece_diff_data
from sp_lab.viz.piece_figure import MODES, build_piece_figure
from sp_lab.viz.report_input import as_report, range_label
from sp_lab.viz.tensor_links import TensorLinks, tensor_links

if TYPE_CHECKING:
    from sp_lab.viz.report_input import ReportSource

__all__ = ["GraphExplorer", "explore"]


class GraphExplorer(widgets.VBox):
    """Range selector, group toggles, the clickable overview, drill-down controls and figure, tensor links.

    The figures shown stay reachable as ``overview_figure`` and ``piece_figure`` (``go.Figure``; the widgets
    drawing them are ``overview_view`` and ``piece_view``), and the last tensor clicked as ``links``;
    :meth:`select` does what a click does.
    """

    def __init__(self, report: ReportSource, range_index: int | None = None) -> None:
        self.report = as_report(report)
        self.data: OverviewData = overview_data(self.report, range_index)
        self.overview_view, self.piece_view = LiveFigure(), LiveFigure()
        self.overview_view.on_click(self._on_click)
        self.piece_figure: go.Figure | None = None
        self.links: TensorLinks | None = None
        self.range_select = widgets.Dropdown(
            options=[(f"{i}: {range_label(r)} ({r.boundary}, SP {'on' if r.enable_sp else 'off'})", i)
                     for i, r in enumerate(self.report.ranges)],
            value=self.data.range_index, description="range", layout=widgets.Layout(width="480px"))
        self.group_toggles = widgets.HBox()
        self.piece_select = widgets.Dropdown(description="piece")
        self.mode_select = widgets.ToggleButtons(options=list(MODES), value="diff", description="show",
                                                 tooltips=["graph after SP + AsyncTP", "graph before the passes",
                                                           "only the rewritten regions, before | after"])
        self.search = widgets.Text(placeholder="op or module, e.g. mm+RS or mlp", description="search",
                                   continuous_update=False)
        self.links_view = widgets.HTML()
        self._overview_box = widgets.Box([self.overview_view])
        self._piece_box = widgets.Box()
        self.range_select.observe(self._on_range, names="value")
        for control in (self.piece_select, self.mode_select, self.search):
            control.observe(self._on_piece_controls, names="value")
        super().__init__([self.range_select, self.group_toggles, self._overview_box, self.links_view,
                          widgets.HBox([self.piece_select, self.mode_select]), self.search, self._piece_box])
        self._load_range(self.data.range_index)

    @property
    def expanded(self) -> list[str]:
        """Ids of the groups currently opened."""
        return [t.tooltip for t in self.group_toggles.children if t.value]

    def select(self, key: str) -> None:
        """Act on a clicked overview item: ``"piece:<i>"`` or ``"group:<id>"`` opens a drill-down,
        ``"tensor:<boundary>:<i>"`` lists that tensor's producers and consumers."""
        kind, _, rest = key.partition(":")
        if kind == "piece":
            piece = self.data.piece(int(rest))
            if piece.kind == "compiled":
                self.piece_select.value = piece.index
            else:
                self.links_view.value = f"<i>{html.escape(piece.name)} is {html.escape(piece.op or 'an eager op')}, " \
                                        "run eagerly between compiled pieces: it has no graph to open</i>"
        elif kind == "group":
            group = next(g for g in self.data.groups if g.id == rest)
            self.piece_select.value = next(i for i in group.block if self.data.piece(i).kind == "compiled")
        elif kind == "tensor":
            boundary, index = (int(v) for v in rest.split(":"))
            self.links = tensor_links(self.report, self.data.range_index, boundary, index)
            self.links_view.value = _links_html(self.links)
        else:
            raise ValueError(f"unknown overview item {key!r}; expected piece:<i>, group:<id> or tensor:<b>:<i>")

    def _load_range(self, range_index: int) -> None:
        self.data = overview_data(self.report, range_index)
        toggles = []
        for g in self.data.groups:
            t = widgets.ToggleButton(value=False, description=f"expand {g.label}", tooltip=g.id)
            t.observe(self._on_toggle, names="value")
            toggles.append(t)
        self.group_toggles.children = toggles
        compiled = [(f"{p.index}: {p.name} ({p.ops_text})", p.index) for p in self.data.pieces if p.kind == "compiled"]
        # Default drill-down: the first piece the passes changed (that is where the story is).
        first_changed = next((p.index for p in self.data.pieces if p.n_changed), compiled[0][1] if compiled else None)
        # Swap options silently: each intermediate value would otherwise redraw the drill-down.
        self.piece_select.unobserve(self._on_piece_controls, names="value")
        self.piece_select.options = compiled
        self.piece_select.value = first_changed
        self.piece_select.observe(self._on_piece_controls, names="value")
        self.links, self.links_view.value = None, ""
        self._draw_overview()
        self._draw_piece()

    def _draw_overview(self) -> None:
        self.overview_view.show(build_overview_figure(self.data, expand=self.expanded))

    def _draw_piece(self) -> None:
        if self.piece_select.value is None:
            self.piece_figure = None
            self._piece_box.children = [widgets.HTML("<i>no compiled piece in this range</i>")]
            return
        data = piece_diff_data(self.report, self.data.range_index, self.piece_select.value)
        self.piece_figure = build_piece_figure(data, self.mode_select.value, search=self.search.value)
        self.piece_view.show(self.piece_figure)
        self._piece_box.children = [self.piece_view]

    @property
    def overview_figure(self) -> go.Figure:
        """The overview shown now."""
        return self.overview_view.current

    def _on_click(self, point: ClickedPoint) -> None:
        if point.meta in ("pieces", "tensors") and point.customdata:
            self.select(str(point.customdata))

    def _on_range(self, change: dict) -> None:
        self._load_range(change["new"])

    def _on_toggle(self, _change: dict) -> None:
        self._draw_overview()

    def _on_piece_controls(self, _change: dict) -> None:
        self._draw_piece()


def _links_html(links: TensorLinks) -> str:
    def items(refs: tuple) -> str:
        return "".join(f"<li>{html.escape(r.text)}</li>" for r in refs) or "<li><i>none found</i></li>"

    how = "" if links.exact else " <i>(matched by shape and dtype: the report does not say which output it is)</i>"
    return (f"<b>{html.escape(links.tensor)}</b> at boundary {links.boundary}{how}"
            f"<br>produced by<ul>{items(links.producers)}</ul>consumed by<ul>{items(links.consumers)}</ul>")


def explore(report: ReportSource, range_index: int | None = None) -> GraphExplorer:
    """Interactive explorer of a CompileReport (the compiler's object, its dict, or a path to its JSON)."""
    return GraphExplorer(report, range_index)
