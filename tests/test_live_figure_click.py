"""The click contract between the browser and the kernel (``sp_lab.viz.live_figure``), checked without a browser.

A click travels: plotly.js emits an event on the plot's div -> the widget's front-end module (``_ESM``) listens to
it by name and sends the kernel a message -> :class:`LiveFigure` reads that message and calls its handlers (the
explorer opens a piece). The Python half is tested elsewhere with a message written by hand; a front end that
listens to another event name, or sends another message, passed those tests and failed only in the browser test.

Here the front-end module itself runs under Node.js (skipped without it) with stand-ins for the page, the widget
model and plotly.js: a plotly click event is fired at whatever the module subscribed to, and the message it sends
is handed to the Python side. The event's name is the one the shipped plotly.js really emits (read from its
source).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

plotly = pytest.importorskip("plotly", reason="plotly is optional on GPU machines")
pytest.importorskip("anywidget", reason="the widgets need anywidget")

from sp_lab.viz import live_figure
from sp_lab.viz.live_figure import ClickedPoint, LiveFigure

CLICK_EVENT = "plotly_click"
EXPLORER = Path(__file__).parent / "data" / "explorer" / "llama_gather.json.gz"

_RUNNER = r"""
const [esmPath, eventJson, version] = process.argv.slice(2);
const handlers = {};
const div = {on: (name, fn) => { handlers[name] = fn; }};
globalThis.document = {createElement: () => div};
globalThis["__sp_lab_plotly_" + version] = Promise.resolve({react: async () => {}, purge: () => {}});
const sent = [];
const model = {get: (key) => (key === "_plotly_version" ? version : key === "figure" ? {} : null),
               send: (message) => sent.push(message), on: () => {}, off: () => {}};
const module = await import(esmPath);
await module.default.render({model, el: {appendChild: () => {}}});
if (handlers[process.env.CLICK_EVENT]) handlers[process.env.CLICK_EVENT](JSON.parse(eventJson));
process.stdout.write(JSON.stringify({subscribed: Object.keys(handlers), sent}));
"""


def _plotly_js_source() -> str:
    return (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text(encoding="utf-8")


def test_the_front_end_listens_to_an_event_plotly_js_emits():
    subscribed = re.findall(r"""\.on\(\s*["'](plotly_\w+)["']""", live_figure._ESM)
    assert subscribed == [CLICK_EVENT], subscribed
    emitted = set(re.findall(r"""emit\(\s*["'](plotly_\w+)["']""", _plotly_js_source()))
    assert CLICK_EVENT in emitted, sorted(emitted)


def _front_end_messages(tmp_path: Path, event: dict) -> dict:
    """Run the front-end module under Node.js, fire ``event`` as plotly.js's click: what it subscribed to and sent."""
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("Node.js is not installed: the front-end module cannot run without a browser")
    esm = tmp_path / "live_figure.mjs"
    esm.write_text(live_figure._ESM)
    runner = tmp_path / "runner.mjs"
    runner.write_text(_RUNNER)
    done = subprocess.run([node, str(runner), esm.as_uri(), json.dumps(event), plotly.__version__], check=True,
                          capture_output=True, text=True, timeout=60, env={"CLICK_EVENT": CLICK_EVENT})
    return json.loads(done.stdout)


def test_a_click_in_the_front_end_reaches_the_kernels_handlers(tmp_path):
    import plotly.graph_objects as go

    fig = go.Figure([go.Scatter(x=[0, 1], y=[0, 1], meta="first"),
                     go.Scatter(x=[0, 1, 2], y=[1, 2, 3], meta="pieces", customdata=["piece:0", "piece:1", "piece:2"])])
    # plotly.js's click event: points with curveNumber, pointNumber (pointIndex on some traces) and customdata
    event = {"points": [{"curveNumber": 1, "pointNumber": 2, "pointIndex": 2, "customdata": "piece:2", "x": 2}]}
    front_end = _front_end_messages(tmp_path, event)
    assert front_end["subscribed"] == [CLICK_EVENT] and len(front_end["sent"]) == 1, front_end
    view, clicked = LiveFigure(fig), []
    view.on_click(clicked.append)
    view._on_front_end_message(view, front_end["sent"][0], [])
    assert clicked == [ClickedPoint(trace=1, meta="pieces", index=2, customdata="piece:2")]


def test_a_front_end_click_on_a_piece_opens_it_in_the_explorer(tmp_path):
    pytest.importorskip("ipywidgets", reason="the explorer needs ipywidgets")
    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed: the explorer's drill-down needs it (apt-get install graphviz)")
    from sp_lab.widgets.explorer import explore

    explorer = explore(EXPLORER)
    fig = explorer.overview_figure
    (trace,) = [i for i, t in enumerate(fig.data) if t.customdata is not None and "piece:4" in list(t.customdata)]
    index = list(fig.data[trace].customdata).index("piece:4")
    event = {"points": [{"curveNumber": trace, "pointNumber": index, "customdata": "piece:4"}]}
    (message,) = _front_end_messages(tmp_path, event)["sent"]
    assert explorer.piece_select.value != 4
    explorer.overview_view._on_front_end_message(explorer.overview_view, message, [])
    assert explorer.piece_select.value == 4 and explorer.piece_figure.layout.title.text.startswith("submod_4")
