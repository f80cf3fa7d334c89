"""Live plots draw every time: under CPU load, while a thread streams updates, after a page reload and after a
kernel restart (``sp_lab.viz.live_figure.LiveFigure`` in a real JupyterLab, headless Chromium).

A small generated notebook displays four live figures at once (the situation in which plotly's own
``FigureWidget`` lost its model: several large widget modules loading together on a busy machine), streams
points into one of them from a background thread (as the tuner's sweep does), and then the test asserts on
what plotly.js really drew, read from the SVG: every figure has its trace groups and non-empty paths, and
the streamed figure shows its last point. Then the page is reloaded (the views are rebuilt from the live
kernel's widget state) and the kernel restarted and the notebook run again; each time every figure must draw.
Busy processes keep every core loaded for the whole test.

The figures are toy data: no compile, so the test takes seconds and can run several times in a row
(``--count`` is not needed: ``for i in 1 2 3 4 5; do pytest tests/browser/test_live_figure_in_jupyterlab.py;
done``).
"""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

# Collected on GPU machines without Jupyter too (pytest -m gpu): skip there, as the other browser tests do.
nbformat = pytest.importorskip("nbformat", reason="the live-figure browser test needs Jupyter (the dev extra)")
from jupyterlab_session import (
    BUSY_JS,
    CHROMIUM,
    CHROMIUM_FLAGS,
    DRAWN_JS,
    Dialogs,
    failure_record,
    require_browser,
    run_all_cells,
    serve_notebook,
    sync_api,
)

pytestmark = [pytest.mark.notebooks]

N_FIGURES = 4
STREAMED = 12
"""Points the background thread adds to the first figure, one redraw each."""

CELLS = [
    f"N_FIGURES, STREAMED = {N_FIGURES}, {STREAMED}",
    """import threading, time
import plotly.graph_objects as go
from sp_lab.viz.live_figure import LiveFigure

def figure(n, k):
    return go.Figure([go.Scatter(x=list(range(1, n + 1)), y=[(i * (k + 1)) % 7 + 1 for i in range(n)],
                                 mode="lines+markers", name=f"series {k}"),
                      go.Scatter(x=[1, n], y=[1, 7], mode="lines", name="reference")],
                     layout={"title": {"text": f"live {k}: {n} points"}, "height": 260, "width": 600})

views = [LiveFigure(figure(3, k)) for k in range(N_FIGURES)]
for v in views:
    display(v)""",
    """def stream():
    for n in range(4, STREAMED + 1):
        views[0].show(figure(n, 0))
        time.sleep(0.05)

worker = threading.Thread(target=stream)
worker.start()
worker.join()
print("streamed", len(views[0].current.data[0].x))""",
]


def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


@pytest.fixture
def cpu_load():
    """One busy process per core for the test's duration: the machine the plots must draw on is loaded."""
    stop = multiprocessing.Event()
    procs = [multiprocessing.Process(target=_burn, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 2)]
    for p in procs:
        p.start()
    yield
    stop.set()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


@pytest.fixture
def lab(tmp_path):
    require_browser()
    notebook = tmp_path / "live_figures.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, notebook)
    with serve_notebook(notebook, tmp_path) as served:
        yield served


def _wait_drawn(page, timeout_s: float = 120.0) -> list[dict]:
    """Every live figure drawn (traces and paths), the streamed one at its last point; else the last reading."""
    deadline = time.monotonic() + timeout_s
    drawn: list[dict] = []
    while time.monotonic() < deadline:
        drawn = [p for p in page.evaluate(DRAWN_JS) if p["live"]]
        if (len(drawn) == N_FIGURES and not page.evaluate(BUSY_JS)
                and all(p["traces"] >= 2 and p["paths"] >= 2 for p in drawn)
                and any(p["title"] == f"live 0: {STREAMED} points" and p["points"] >= STREAMED for p in drawn)):
            return drawn
        time.sleep(0.5)
    return drawn


def _assert_drawn(drawn: list[dict], when: str) -> None:
    assert len(drawn) == N_FIGURES, f"{when}: {len(drawn)} of {N_FIGURES} live figures on the page: {drawn}"
    blank = [p for p in drawn if p["traces"] < 2 or p["paths"] < 2]
    assert not blank, f"{when}: live figures with nothing drawn (blank axes): {blank}"
    assert any(p["title"] == f"live 0: {STREAMED} points" and p["points"] >= STREAMED for p in drawn), (
        f"{when}: the streamed figure does not show its last update: {drawn}")


def test_live_figures_draw_under_load_after_reload_and_restart(lab, cpu_load, tmp_path):
    base, token, name = lab.base, lab.token, lab.name
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1200, "height": 1600})
        dialogs = Dialogs(page)
        try:
            with failure_record(page, "live_figure", tmp_path / "jupyterlab.log", dialogs):
                page.goto(f"{base}/lab/tree/{name}?token={token}")
                run_all_cells(page, dialogs)
                _assert_drawn(_wait_drawn(page), "first run")

                # Saved first, as a person's notebook is autosaved: the reloaded page finds the widget outputs
                # in the file and rebuilds their views from the kernel's widget state.
                page.locator(".jp-Notebook").first.click()
                page.keyboard.press("Control+s")
                page.wait_for_selector("#jp-main-statusbar :text('Saving completed')", timeout=30_000)
                page.reload()
                page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
                dialogs.dismiss()
                _assert_drawn(_wait_drawn(page), "after a page reload")

                dialogs.dismiss()
                page.locator(".lm-MenuBar-itemLabel", has_text="Kernel").first.click()
                page.locator(".lm-Menu-itemLabel", has_text="Restart Kernel and Run All Cells").first.click()
                dialogs.accept()
                time.sleep(2)  # the old outputs are cleared before the cells run again
                _assert_drawn(_wait_drawn(page), "after a kernel restart")
        finally:
            browser.close()

