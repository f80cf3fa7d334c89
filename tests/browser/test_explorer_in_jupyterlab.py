"""Notebook 2's split-graph explorer in a real JupyterLab, driven by headless Chromium: click a piece, see its
drill-down.

Same set-up as the tuner's browser test (whose helpers it imports): JupyterLab on 127.0.0.1 with a random port
and token, serving a copy of ``notebooks/02_split_graph_explorer.ipynb`` under ``.cache/`` (so autosave never
writes outputs into the committed notebook). The test runs every cell, then, in the explorer widget (the last
cell's output):

1. clicks the box of piece 2 in the overview (a mouse click on the plotly figure, handled by the FigureWidget's
   click callback in the kernel);
2. asserts that the drill-down below now shows piece 2 (``submod_2`` in its title) with its rewritten regions.

Screenshots of the overview and the drill-down go to ``artifacts/`` (and to ``docs/img/`` when
``SP_LAB_UPDATE_SCREENSHOT=1``). Skipped, with the reason, without chromium, the playwright package or Graphviz.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_tuner_in_jupyterlab import BUSY_JS, CHROMIUM, CHROMIUM_FLAGS, _free_port, _wait_http

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "02_split_graph_explorer.ipynb"
RUN_TIMEOUT_S = 600

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (its browsers are not needed)")
pytestmark = [
    pytest.mark.notebooks,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install -y chromium)"),
    pytest.mark.skipif(shutil.which("dot") is None, reason="no Graphviz dot on PATH (apt-get install -y graphviz)"),
]

# Title and trace names of every plotly figure on the page, in document order.
FIGURES_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(el => ({
    title: String(((el.layout || {}).title || {}).text || ''),
    traces: (el.data || []).map(t => String(t.meta || t.name || ''))}))"""


@pytest.fixture
def lab(tmp_path):
    """(base URL, token, notebook name) of a JupyterLab serving a copy of notebook 2."""
    workdir = ROOT / ".cache" / f"browser-{secrets.token_hex(4)}"  # under the repo: the notebook finds ROOT
    workdir.mkdir(parents=True)
    shutil.copy(NOTEBOOK, workdir / NOTEBOOK.name)
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "SP_LAB_SMOKE": "1", "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter-config"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-workspaces")}
    log_path = tmp_path / "jupyterlab.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={workdir}",
             *(["--allow-root"] if os.geteuid() == 0 else [])],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_http(f"http://127.0.0.1:{port}/api/status?token={token}", proc, log_path)
            yield f"http://127.0.0.1:{port}", token, NOTEBOOK.name
        finally:
            if proc.poll() is None:  # the server and the kernels it started: one process group
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            shutil.rmtree(workdir, ignore_errors=True)


def _run_all_cells(page) -> None:
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle'], "
                           "#jp-main-statusbar :text('Idle')", timeout=90_000)
    # Run > Run All Cells; retried once if no cell starts (a click before the kernel is connected is dropped).
    for _attempt in range(2):
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:
            page.wait_for_function(BUSY_JS, timeout=30_000)
            return
        except sync_api.TimeoutError:
            page.keyboard.press("Escape")


def _drilldown_titles(page) -> list[str]:
    return [f["title"] for f in page.evaluate(FIGURES_JS) if f["title"].startswith("submod_")]


def test_clicking_a_piece_opens_its_drilldown(lab):
    base, token, name = lab
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1200})
            page.goto(f"{base}/lab/tree/{name}?token={token}")
            _run_all_cells(page)
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while time.monotonic() < deadline and (page.evaluate(BUSY_JS) or not _drilldown_titles(page)):
                time.sleep(2)
            assert not page.evaluate(BUSY_JS), f"notebook still running after {RUN_TIMEOUT_S} s"
            before = _drilldown_titles(page)
            assert before, "the explorer drew no drill-down"
            assert not any(t.startswith("submod_2 ") for t in before[-1:]), before

            no_news = page.locator(".jp-toast-button", has_text="No")  # JupyterLab's news prompt
            if no_news.count():
                no_news.first.click()
            explorer = page.locator(".jp-OutputArea-output .widget-vbox").last
            explorer.scroll_into_view_if_needed()
            overview = explorer.locator(".js-plotly-plot").first
            label = overview.locator(".textpoint text", has_text="piece 2").first
            box = label.bounding_box()
            assert box is not None, "piece 2 is not drawn in the explorer's overview"
            # Plotly picks the clicked point by hover; a real mouse move then click, as a person does.
            page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            time.sleep(0.5)
            page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            titles: list[str] = []
            for _ in range(60):
                time.sleep(0.5)
                titles = _drilldown_titles(page)
                if titles and titles[-1].startswith("submod_2 "):
                    break
            assert titles and titles[-1].startswith("submod_2 "), f"no drill-down of piece 2 after the click: {titles}"
            drilldown = explorer.locator(".js-plotly-plot").last
            assert "rewritten region" in titles[-1]  # the diff mode: only what SP and AsyncTP rewrote

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
