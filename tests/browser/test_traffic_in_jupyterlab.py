"""Notebook 7 (does SP + AsyncTP pay on my traffic?) in a real JupyterLab, driven by headless Chromium: every cell
runs and every plot is drawn -- the step-size histogram under the latency curves with its thresholds, and TTFT /
TPOT per policy.

Same set-up as the other browser tests (``jupyterlab_session``): a copy of ``notebooks/07_traffic.ipynb`` served
from ``.cache/``, the executed copy recorded for ``tests/test_notebooks.py``. A screenshot of the step-size plot
goes to ``artifacts/`` (and ``docs/img/traffic.png`` with ``SP_LAB_UPDATE_SCREENSHOT=1``). Without Chromium or
Playwright it is skipped with the reason on a workstation and fails under CI (``CI`` set).
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
    Dialogs,
    failure_record,
    require_browser,
    run_all_cells,
    save_and_record,
    serve_notebook,
    sync_api,
)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "07_traffic.ipynb"
RUN_TIMEOUT_S = 600
PLOTS = 3
"""Chat's step sizes (curves and histogram in one figure) and its TTFT / TPOT, the summaries' step sizes."""

pytestmark = [pytest.mark.notebooks]

# Every plotly plot on the page with what plotly.js drew: trace groups in any layer (lines, fills, bars) and the
# SVG paths with a non-empty "d"; a blank plot (empty axes) has neither.
DRAWN_ANY_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(el => ({
    traces: el.querySelectorAll('.scatterlayer .trace, .barlayer .trace').length,
    paths: Array.from(el.querySelectorAll('.scatterlayer .trace path, .barlayer .trace path'))
        .filter(p => (p.getAttribute('d') || '').length > 2).length,
    annotations: Array.from(el.querySelectorAll('.annotation-text')).map(t => t.textContent),
    title: String(((el.layout || {}).title || {}).text || '')}))"""


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab serving a copy of notebook 7 (``jupyterlab_session.Served``)."""
    require_browser()
    with serve_notebook(NOTEBOOK, tmp_path) as served:
        yield served


def test_traffic_notebook_draws_every_plot(lab, tmp_path):
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2000})
            dialogs = Dialogs(page)
            with failure_record(page, "traffic", tmp_path / "jupyterlab.log", dialogs):
                page.goto(f"{lab.base}/lab/tree/{lab.name}?token={lab.token}")
                run_all_cells(page, dialogs)
                deadline = time.monotonic() + RUN_TIMEOUT_S
                while time.monotonic() < deadline and (page.evaluate(BUSY_JS)
                                                       or len(page.evaluate(DRAWN_ANY_JS)) < PLOTS):
                    time.sleep(2)
                assert not page.evaluate(BUSY_JS), f"notebook still running after {RUN_TIMEOUT_S} s"
                save_and_record(page, lab)  # every cell ran, none raised: test_notebooks.py checks this run
                dialogs.dismiss()
                # JupyterLab may leave outputs outside the window undrawn: bring each plot into view first
                for i in range(page.locator(".js-plotly-plot").count()):
                    page.locator(".js-plotly-plot").nth(i).scroll_into_view_if_needed()
                    time.sleep(1.0)
                plots = page.evaluate(DRAWN_ANY_JS)
                titles = [p["title"] for p in plots]
                assert len(plots) == PLOTS, f"expected chat's two plots and the summaries' one, got {titles}"
                assert all(p["traces"] > 0 and p["paths"] > 0 for p in plots), f"a plot is blank: {plots}"
                assert sum("Where the traffic's time goes (PREDICTED rows)" in t for t in titles) == 2, titles
                assert any("TTFT and TPOT per policy (PREDICTED rows)" in t for t in titles), titles
                # the thresholds are drawn on the step-size plots (vertical lines with their labels in the SVG)
                steps = [p for p in plots if p["title"].startswith("Where the traffic's time goes")]
                assert all(any(a.startswith("threshold per count") for a in p["annotations"]) for p in steps), steps
                first = page.locator(".js-plotly-plot").first
                first.scroll_into_view_if_needed()
                artifacts = ROOT / "artifacts"
                artifacts.mkdir(exist_ok=True)
                page.mouse.move(5, 5)
                time.sleep(0.5)
                first.screenshot(path=str(artifacts / "traffic.png"))
                if os.environ.get("SP_LAB_UPDATE_SCREENSHOT") == "1":
                    (ROOT / "docs" / "img").mkdir(parents=True, exist_ok=True)
                    shutil.copy(artifacts / "traffic.png", ROOT / "docs" / "img" / "traffic.png")
        finally:
            browser.close()
