"""A plotly figure in JupyterLab that always draws: the whole figure is the widget's state, drawn by plotly.js.

Why not plotly's own ``go.FigureWidget``: since plotly 6 it is an anywidget whose front-end module is plotly's
5 MB widget bundle, and anywidget gives a model 2 s to load its module (``AbortSignal.timeout(2000)`` in
anywidget's runtime: "[anywidget] Failed to initialize model."). On a loaded machine, or when a page reload
restores several widgets at once, importing that bundle takes longer; the model is then never initialised and
every later message to it is dropped, so the plot keeps its empty axes while the widgets around it update.
FigureWidget also sends edits as one-shot messages (``_py2js_addTraces`` set, then reset to ``None``): a view
that was not listening when they passed, e.g. after a reload, never sees them.

:class:`LiveFigure` avoids both. Its front-end module is a few lines (it initialises in milliseconds under any
load); plotly.js (the copy shipped inside the plotly Python package, so nothing is fetched from the network)
is the state of one shared widget per kernel (so a reload restores it once, not once per figure: JupyterLab
gives the restore of all widget states 4 s), loaded once per page by the first view that needs it, outside
anywidget's time limit. The figure itself is one synced value, the full plotly JSON: any view, created at any
time (a reload, a second display, a slow front end), draws the figure as it is now, and each change redraws
with ``Plotly.react``. Clicks on points come back to the kernel as messages (:meth:`LiveFigure.on_click`).

    view = LiveFigure(fig)          # display it; view.show(new_fig) redraws every view of it
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import anywidget
import ipywidgets
import plotly
import plotly.graph_objects as go
import traitlets

__all__ = ["ClickedPoint", "LiveFigure"]

_ESM = r"""
// One plotly.js per page, shared by every view (keyed by version: two plotly packages may meet in one page).
// Its source is the state of one shared model per kernel (``_plotly``), not of every figure: a page reload
// restores every widget's state in one message that JupyterLab waits 4 s for.
function loadPlotly(model) {
  const key = "__sp_lab_plotly_" + model.get("_plotly_version");
  if (!globalThis[key]) {
    globalThis[key] = new Promise(async (resolve, reject) => {
      const ref = String(model.get("_plotly")).replace("IPY_MODEL_", "");
      let source;
      try {
        source = (await model.widget_manager.get_model(ref)).get("source");
      } catch (err) {
        delete globalThis[key];
        reject(new Error("the plotly.js model is not in this page yet: " + err));
        return;
      }
      const url = URL.createObjectURL(new Blob([source], {type: "text/javascript"}));
      const script = document.createElement("script");
      script.src = url;
      script.onload = () => { URL.revokeObjectURL(url); resolve(window.Plotly); };
      script.onerror = () => reject(new Error("plotly.js did not load"));
      document.head.appendChild(script);
    });
  }
  return globalThis[key];
}

async function render({ model, el }) {
  const div = document.createElement("div");
  div.className = "sp-lab-live-figure";
  el.appendChild(div);
  let Plotly;
  try {
    Plotly = await loadPlotly(model);
  } catch (err) {
    div.textContent = "sp_lab: " + err.message;
    return;
  }
  const draw = () => {
    const fig = model.get("figure") || {};
    return Plotly.react(div, fig.data || [], fig.layout || {}, {displaylogo: false, ...(fig.config || {})});
  };
  await draw();
  div.on("plotly_click", (event) => {
    const points = event.points.map((p) => ({curve: p.curveNumber, index: p.pointIndex ?? p.pointNumber,
                                             customdata: p.customdata ?? null}));
    model.send({event: "click", points});
  });
  model.on("change:figure", draw);
  return () => { model.off("change:figure", draw); Plotly.purge(div); };
}
export default { render };
"""


class _PlotlyJs(anywidget.AnyWidget):
    """plotly.js as shipped in the plotly Python package, sent to the page once per kernel (never displayed)."""

    _esm = "export default {};"
    source = traitlets.Unicode().tag(sync=True)


@functools.cache
def _plotly_js() -> _PlotlyJs:
    """The one plotly.js model of this kernel (the version the figures' JSON is written for)."""
    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return _PlotlyJs(source=path.read_text(encoding="utf-8"))


class ClickedPoint(NamedTuple):
    """A point clicked in the browser: its trace (index and ``meta``), its index in the trace, its customdata."""

    trace: int
    meta: Any
    index: int
    customdata: Any


class LiveFigure(anywidget.AnyWidget):
    """Shows a plotly figure in the notebook and redraws every view of it on :meth:`show` (see the module doc).

    ``current`` is the figure shown (a ``go.Figure``: tests and callers read its traces); ``figure`` its JSON
    as synced to the browser.
    """

    _esm = _ESM
    figure = traitlets.Dict().tag(sync=True)
    _plotly = traitlets.Instance(_PlotlyJs).tag(sync=True, **ipywidgets.widget_serialization)
    _plotly_version = traitlets.Unicode().tag(sync=True)

    def __init__(self, fig: go.Figure | None = None, **kwargs: Any) -> None:
        super().__init__(_plotly=_plotly_js(), _plotly_version=plotly.__version__, **kwargs)
        self.current = go.Figure()
        self._click_handlers: list[Callable[[ClickedPoint], None]] = []
        self.on_msg(self._on_front_end_message)
        if fig is not None:
            self.show(fig)

    def show(self, fig: go.Figure) -> None:
        """Draw ``fig`` in every view of this widget (the whole figure is sent: views never miss an edit)."""
        self.current = fig
        # plotly's own encoder: numpy arrays, dates and NaN become what plotly.js reads.
        self.figure = json.loads(fig.to_json())

    def on_click(self, handler: Callable[[ClickedPoint], None]) -> None:
        """Call ``handler(point)`` for each point clicked in the browser."""
        self._click_handlers.append(handler)

    def click(self, trace: int, index: int) -> None:
        """Do what a click on point ``index`` of trace ``trace`` does (scripts and tests; the browser sends the same)."""
        customdata = self.current.data[trace].customdata
        self._on_front_end_message(self, {"event": "click", "points": [
            {"curve": trace, "index": index, "customdata": None if customdata is None else customdata[index]}]}, [])

    def _on_front_end_message(self, _widget: Any, content: dict, _buffers: list) -> None:
        if not isinstance(content, dict) or content.get("event") != "click":
            return
        for p in content.get("points", []):
            trace = int(p["curve"])
            meta = self.current.data[trace].meta if trace < len(self.current.data) else None
            point = ClickedPoint(trace=trace, meta=meta, index=int(p["index"]), customdata=p.get("customdata"))
            for handler in self._click_handlers:
                handler(point)
