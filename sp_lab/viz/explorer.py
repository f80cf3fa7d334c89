"""The split-graph explorer's public face: ``plot_overview``, ``plot_piece``, ``plot_compare`` and their data.

Everything reads a saved CompileReport (a path, ``.json.gz`` too, its dict or the compiler's object); nothing
reaches into the compiler, so a report saved on a GPU box can be explored on a laptop. Each view comes in
Optuna's three layers: a data function returning plain records the tests assert on, a figure builder taking
only that data, and the thin ``plot_*`` here. The layers live in modules named for what they hold:

==========================  ===============================================================
``report_input``            reading a report (``load_report``, ``as_report``)
``overview``                pieces, boundaries, failures, collapsed layers (``overview_data``)
``overview_figure``         the lane of piece boxes (``build_overview_figure``)
``piece_graph``             a piece's graph collapsed for reading (runs, folded weights, modules)
``piece_diff``              before/after and the rewritten regions (``piece_diff_data``)
``dag_layout``              Graphviz ``dot`` positions (why ``dot``: see that module)
``piece_figure``            the drill-down (``build_piece_figure``; modes after, before, diff)
``tensor_links``            a boundary tensor's producers and consumers
``compare``, ``tables``     two reports side by side; polars tables
``export``                  ``save_html``, ``emit_trace`` (tlparse)
==========================  ===============================================================
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from sp_lab.viz.compare import build_compare_figure, compare_data
from sp_lab.viz.dag_layout import GraphvizMissing, dot_layout
from sp_lab.viz.export import emit_trace, save_html
from sp_lab.viz.overview import (
    BoundaryLabel,
    ErasedCopy,
    FailureMark,
    OverviewData,
    PieceBox,
    PieceGroup,
    crossing_text,
    format_shape,
    ops_summary,
    overview_data,
    range_title,
)
from sp_lab.viz.overview_figure import build_overview_figure
from sp_lab.viz.piece_diff import DiffRegion, PieceDiffData, piece_diff_data
from sp_lab.viz.piece_figure import build_piece_figure
from sp_lab.viz.piece_graph import GraphNode, PieceGraph, collapse
from sp_lab.viz.report_input import as_report, load_report, range_label, report_provenance
from sp_lab.viz.tables import compact, piece_table, range_table, show_whole_tables
from sp_lab.viz.tensor_links import TensorLinks, tensor_links

if TYPE_CHECKING:
    from sp_lab.viz.report_input import ReportSource

__all__ = [
    "BoundaryLabel", "DiffRegion", "ErasedCopy", "FailureMark", "GraphNode", "GraphvizMissing", "OverviewData",
    "PieceBox", "PieceDiffData", "PieceGraph", "PieceGroup", "TensorLinks",
    "as_report", "build_compare_figure", "build_overview_figure", "build_piece_figure", "collapse", "compact",
    "compare_data",
    "crossing_text",
    "dot_layout", "emit_trace", "format_shape", "load_report", "ops_summary", "overview_data", "piece_diff_data",
    "piece_table", "plot_compare", "plot_overview", "plot_piece", "range_label", "range_table", "range_title",
    "report_provenance",
    "save_html", "show_whole_tables", "tensor_links",
]


def plot_overview(report: ReportSource, range_index: int | None = None, *, expand: bool | Iterable[str] = False,
                  widget: bool = False) -> go.Figure:
    """Overview of one compile range: pieces (what each runs), boundaries (bytes per token), failures in red,
    erased copies, identical layers collapsed.

    ``expand``: False keeps identical layers collapsed, True opens them all, a list of group ids
    (``overview_data(report).groups``) opens those. ``widget=True`` returns a :class:`~sp_lab.viz.live_figure.LiveFigure`.
    """
    return _maybe_widget(build_overview_figure(overview_data(report, range_index), expand=expand), widget)


def plot_piece(report: ReportSource, piece_index: int, range_index: int | None = None, *, mode: str = "after",
               search: str = "", widget: bool = False) -> go.Figure:
    """Drill-down into one piece as a layered graph: ``mode`` "after" / "before" the passes, or "diff" (only the
    rewritten neighbourhoods, before | after). ``search`` outlines nodes whose op or module contains it."""
    return _maybe_widget(build_piece_figure(piece_diff_data(report, range_index, piece_index), mode, search=search),
                         widget)


def plot_compare(report_a: ReportSource, report_b: ReportSource, *, range_a: int | None = None, range_b: int | None = None,
                 labels: tuple[str, str] | None = None, widget: bool = False) -> go.Figure:
    """Compare two reports (e.g. boundary "gather" vs "sharded") or two ranges of one report."""
    frame = compare_data(report_a, report_b, range_a=range_a, range_b=range_b, labels=labels)
    return _maybe_widget(build_compare_figure(frame), widget)


def _maybe_widget(fig: go.Figure, widget: bool) -> go.Figure:
    if not widget:
        return fig
    from sp_lab.viz.live_figure import LiveFigure  # needs anywidget

    return LiveFigure(fig)
