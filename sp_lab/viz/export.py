"""Figures out of the notebook: standalone HTML, and torch's structured trace for tlparse users."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from sp_lab.viz.overview import overview_data
from sp_lab.viz.report_input import as_report

if TYPE_CHECKING:
    from sp_lab.viz.report_input import ReportSource

__all__ = ["emit_trace", "save_html"]


def save_html(figs: go.Figure | Sequence[go.Figure], path: str | Path, *, title: str = "sp_lab report",
              include_plotlyjs: bool | str = True) -> Path:
    """Write one or several figures to one standalone HTML file (plotly.js embedded by default, so
    it opens offline; pass ``include_plotlyjs="cdn"`` for a ~4 MB smaller file)."""
    figs = [figs] if isinstance(figs, go.Figure) else list(figs)
    if not figs:
        raise ValueError("save_html needs at least one figure")
    divs = [f.to_html(full_html=False, include_plotlyjs=include_plotlyjs if i == 0 else False)
            for i, f in enumerate(figs)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{title}</title></head>\n"
                    f"<body>\n" + "\n".join(divs) + "\n</body></html>\n", encoding="utf-8")
    return path


def emit_trace(report: ReportSource, *, include_overview: bool = True) -> bool:
    """Send the report (and each range's overview data) to torch's structured trace for tlparse.

    Artifacts: ``sp_lab_compile_report`` (the report JSON) and ``sp_lab_overview_<range>`` (the data
    behind ``plot_overview``). Only written when structured tracing is on (``TORCH_TRACE=<dir>``).
    Returns False, with a warning, when this torch has no compatible ``trace_structured``.
    """
    report = as_report(report)
    try:
        from torch._logging import trace_structured
    except ImportError as err:
        warnings.warn(f"torch._logging.trace_structured is unavailable ({err}); report not traced", stacklevel=2)
        return False
    params = inspect.signature(trace_structured).parameters
    if "metadata_fn" not in params or "payload_fn" not in params:
        warnings.warn("torch._logging.trace_structured has no metadata_fn/payload_fn parameters on this torch; "
                      "report not traced (save it with save_html or report.to_json instead)", stacklevel=2)
        return False
    # Outside a compile there is no trace id; saying so stops torch from logging our stack every time.
    extra = {"expect_trace_id": False} if "expect_trace_id" in params else {}
    payload = report.to_dict()
    # Dict payloads are serialised by torch with one value per line, which keeps tlparse's lines short.
    trace_structured("artifact", metadata_fn=lambda: {"name": "sp_lab_compile_report", "encoding": "json"},
                     payload_fn=lambda: payload, **extra)
    if include_overview:
        for ri in range(len(report.ranges)):
            name = f"sp_lab_overview_{ri}"
            trace_structured("artifact", metadata_fn=lambda name=name: {"name": name, "encoding": "json"},
                             payload_fn=lambda ri=ri: overview_data(report, ri).to_dict(), **extra)
    return True
