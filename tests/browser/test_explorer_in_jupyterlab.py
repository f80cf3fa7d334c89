"""Notebook 2's split-graph explorer in a real JupyterLab, driven by headless Chromium: click a piece, see its
drill-down.

Same set-up as the tuner's browser test (``jupyterlab_session``): JupyterLab on 127.0.0.1 with a random port
and token, serving a copy of ``notebooks/02_split_graph_explorer.ipynb`` under ``.cache/`` (so autosave never
writes outputs into the committed notebook). The test runs every cell, then, in the explorer widget (the last
cell's output):

1. clicks the box of piece 2 in the overview (a mouse click on the plotly figure, handled by the FigureWidget's
   click callback in the kernel);
2. asserts that the drill-down below now shows piece 2 (``submod_2`` in its title) with its rewritten regions.

Screenshots of the overview and the drill-down go to ``artifacts/`` (and to ``docs/img/`` when
``SP_LAB_UPDATE_SCREENSHOT=1``). Without chromium, the playwright package or Graphviz it is skipped with the
reason on a workstation and fails under CI (``CI`` set).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from jupyterlab_session import (
    BUSY_JS,
    CHROMIUM,
    CHROMIUM_FLAGS,
    DRAWN_JS,
    Dialogs,
    failure_record,
    missing,
    require_browser,
    run_all_cells,
    save_and_record,
    serve_notebook,
    sync_api,
)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "02_split_graph_explorer.ipynb"
RUN_TIMEOUT_S = 600

pytestmark = [pytest.mark.notebooks]

@pytest.fixture
def lab(tmp_path):
    """A JupyterLab serving a copy of notebook 2 (``jupyterlab_session.Served``)."""
    require_browser()
    if shutil.which("dot") is None:
        missing("no Graphviz dot on PATH (apt-get install -y graphviz)")
    with serve_notebook(NOTEBOOK, tmp_path) as served:
        yield served


def _title(plot) -> str:
    """The title of a plotly figure on the page (plotly keeps its layout on the graph div)."""
    return plot.evaluate("el => String(((el.layout || {}).title || {}).text || '')")


# The explorer: the widget box holding two plotly figures (overview and drill-down) in the last cell's output.
EXPLORER_READY_JS = """() => { const outs = document.querySelectorAll('.jp-Cell:last-child .jp-OutputArea-output');
    return Array.from(outs).some(o => o.querySelectorAll('.js-plotly-plot').length >= 2); }"""


def test_clicking_a_piece_opens_its_drilldown(lab, tmp_path):
    base, token, name = lab.base, lab.token, lab.name
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 2400})  # the drill-down fits
            dialogs = Dialogs(page)
            with failure_record(page, "explorer", tmp_path / "jupyterlab.log", dialogs):
                page.goto(f"{base}/lab/tree/{name}?token={token}")
                run_all_cells(page, dialogs)
                deadline = time.monotonic() + RUN_TIMEOUT_S
                while time.monotonic() < deadline and (page.evaluate(BUSY_JS) or not page.evaluate(EXPLORER_READY_JS)):
                    time.sleep(2)
                assert not page.evaluate(BUSY_JS), f"notebook still running after {RUN_TIMEOUT_S} s"
                assert page.evaluate(EXPLORER_READY_JS), "the explorer widget did not render its two figures"
                save_and_record(page, lab)  # every cell ran, none raised: test_notebooks.py checks this run

                dialogs.dismiss()
                # Drawn, not only given data: the overview's boxes and labels and the drill-down are in the SVG.
                drawn = [p for p in page.evaluate(DRAWN_JS) if p["live"]]
                assert len(drawn) >= 2 and all(p["traces"] > 0 and p["points"] > 0 for p in drawn), (
                    f"a live plot of the explorer is blank: {drawn}")
                explorer = page.locator(".jp-Cell:last-child .jp-OutputArea-output .widget-vbox").first
                explorer.scroll_into_view_if_needed()
                overview = explorer.locator(".js-plotly-plot").first
                before = _title(explorer.locator(".js-plotly-plot").last)
                assert not before.startswith("submod_2 "), before  # the default drill-down is another piece
                label = overview.locator(".textpoint text", has_text="piece 2").first
                box = label.bounding_box()
                assert box is not None, "piece 2 is not drawn in the explorer's overview"
                # Plotly picks the clicked point by hover; a real mouse move then click, as a person does.
                page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
                time.sleep(0.5)
                page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
                title = before
                for _ in range(120):
                    time.sleep(0.5)
                    title = _title(explorer.locator(".js-plotly-plot").last)
                    if title.startswith("submod_2 "):
                        break
                assert title.startswith("submod_2 "), f"no drill-down of piece 2 after the click: {title!r}"
                assert "rewritten region" in title  # the diff mode: only what SP and AsyncTP rewrote
                drilldown = explorer.locator(".js-plotly-plot").last

                artifacts = ROOT / "artifacts"
                artifacts.mkdir(exist_ok=True)
                page.mouse.move(5, 5)  # no hover label over the screenshot
                time.sleep(0.5)
                overview.scroll_into_view_if_needed()
                overview.screenshot(path=str(artifacts / "explorer_overview.png"))
                drilldown.scroll_into_view_if_needed()
                drilldown.screenshot(path=str(artifacts / "explorer_drilldown.png"))
                if os.environ.get("SP_LAB_UPDATE_SCREENSHOT") == "1":
                    (ROOT / "docs" / "img").mkdir(parents=True, exist_ok=True)
                    for shot in ("explorer_overview.png", "explorer_drilldown.png"):
                        shutil.copy(artifacts / shot, ROOT / "docs" / "img" / shot)
        finally:
            browser.close()
