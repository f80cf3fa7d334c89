"""A notebook front end for the split-graph explorer: pick a range, open collapsed layers, drill down.

Plain plotly cannot expand a collapsed group in place, so this widget re-draws the overview from
the same data layer (``sp_lab.viz.graph``) whenever a group toggle changes. It holds no logic of
its own beyond wiring controls to ``build_*_figure`` calls.

    from sp_lab.widgets.explorer import explore
    explore("tests/data/report_toy_sharded.json")
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
from IPython import get_ipython
from IPython.display import display

from sp_lab.viz.graph import (
    OverviewData,
    as_report_dict,
    build_overview_figure,
    build_piece_figure,
    overview_data,
    piece_diff_data,
)


class GraphExplorer(widgets.VBox):
    """Range selector, one toggle per collapsed group, a piece drill-down selector and two plots.

    The current figures stay reachable as ``overview_figure`` and ``piece_figure`` (plain
    ``go.Figure``), which is what tests and "save this view" cells use.
    """

    def __init__(self, report: Any, range_index: int | None = None) -> None:
        self.report = as_report_dict(report)
        self.data: OverviewData = overview_data(self.report, range_index)
        self.overview_figure: go.Figure | None = None
        self.piece_figure: go.Figure | None = None
        ranges = self.report["ranges"]
        self.range_select = widgets.Dropdown(
            options=[(f"{i}: tokens {r['lo']}-{r['hi']} ({r.get('boundary')}, SP {'on' if r.get('enable_sp') else 'off'})",
                      i) for i, r in enumerate(ranges)],
            value=self.data.range.index, description="range")
        self.group_toggles = widgets.HBox()
        self.piece_select = widgets.Dropdown(description="piece")
        self._overview_out = widgets.Output()
        self._piece_out = widgets.Output()
        self.range_select.observe(self._on_range, names="value")
        self.piece_select.observe(self._on_piece, names="value")
        super().__init__([self.range_select, self.group_toggles, self._overview_out, self.piece_select,
                          self._piece_out])
        self._load_range(self.data.range.index)

    @property
    def expanded(self) -> list[str]:
        """Ids of the groups currently opened."""
        return [t.tooltip for t in self.group_toggles.children if t.value]

    def _load_range(self, range_index: int) -> None:
        self.data = overview_data(self.report, range_index)
        toggles = []
        for g in self.data.groups:
            t = widgets.ToggleButton(value=False, description=f"expand {g.label}", tooltip=g.id)
            t.observe(self._on_toggle, names="value")
            toggles.append(t)
        self.group_toggles.children = toggles
        compiled = [(f"{p.index}: {p.name}", p.index) for p in self.data.pieces if p.kind == "compiled"]
        # Default drill-down: the first piece the passes changed (that is where the story is).
        first_changed = next((p.index for p in self.data.pieces if p.n_changed), compiled[0][1] if compiled else None)
        # Swap options silently: each intermediate value would otherwise redraw the drill-down.
        self.piece_select.unobserve(self._on_piece, names="value")
        self.piece_select.options = compiled
        self.piece_select.value = first_changed
        self.piece_select.observe(self._on_piece, names="value")
        self._draw_overview()
        self._draw_piece()

    def _draw_overview(self) -> None:
        self.overview_figure = build_overview_figure(self.data, expand=self.expanded)
        _show(self._overview_out, self.overview_figure)

    def _draw_piece(self) -> None:
        if self.piece_select.value is None:
            self.piece_figure = None
            return
        self.piece_figure = build_piece_figure(
            piece_diff_data(self.report, self.data.range.index, self.piece_select.value))
        _show(self._piece_out, self.piece_figure)

    def _on_range(self, change: dict) -> None:
        self._load_range(change["new"])

    def _on_toggle(self, _change: dict) -> None:
        self._draw_overview()

    def _on_piece(self, _change: dict) -> None:
        self._draw_piece()


def _show(out: widgets.Output, fig: go.Figure) -> None:
    # Outside a kernel (scripts, tests) display() would print the figure's whole JSON repr.
    if get_ipython() is None:
        return
    out.clear_output(wait=True)
    with out:
        display(fig)


def explore(report: Any, range_index: int | None = None) -> GraphExplorer:
    """Interactive explorer of a CompileReport (dict, path to its JSON, or ``CompileReport``)."""
    return GraphExplorer(report, range_index)


__all__ = ["GraphExplorer", "explore"]
