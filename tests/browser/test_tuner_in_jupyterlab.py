"""Notebook 3 in a real JupyterLab, driven by headless Chromium (Debian's ``chromium`` + Playwright).

JupyterLab is started on 127.0.0.1 with a random port and token, on a copy of
``notebooks/03_tune_async_tp_min_tokens.ipynb`` under ``.cache/`` (so the UI's autosave never writes
outputs into the committed notebook). The test runs every cell from the Run menu with the smoke
setting, then asserts on what the browser shows:

1. the tuner's latency plot holds measured points (plotly trace data read from the DOM);
2. moving the ``async_tp_min_tokens`` slider changes the gated curve.

A screenshot of the tuner goes to ``artifacts/tuner.png`` (and to ``docs/img/tuner.png`` when
``SP_LAB_UPDATE_SCREENSHOT=1``). Skipped, with the reason, without chromium or the playwright package;
browsers are never downloaded (``playwright install`` is not used).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "03_tune_async_tp_min_tokens.ipynb"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_TIMEOUT_S = 420

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (its browsers are not needed)")
pytestmark = [
    pytest.mark.notebooks,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install -y chromium)"),
]

# Plotly keeps each figure's traces on its graph div (gd.data); FigureWidget renders into one too.
PLOTS_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(el =>
    (el.data || []).map(t => ({name: t.name || '', meta: String(t.meta || ''),
                              x: Array.from(t.x || []), y: Array.from(t.y || [])})))"""
BUSY_JS = """() => Array.from(document.querySelectorAll('.jp-InputArea-prompt'))
    .some(el => el.textContent.includes('*'))"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with status {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"jupyter lab did not answer at {url} within {timeout:.0f} s")


@pytest.fixture
def lab(tmp_path):
    """(base URL, token, notebook name) of a JupyterLab serving a copy of notebook 3."""
    workdir = ROOT / ".cache" / f"browser-{secrets.token_hex(4)}"  # under the repo: the notebook finds ROOT
    workdir.mkdir(parents=True)
    shutil.copy(NOTEBOOK, workdir / NOTEBOOK.name)
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "SP_LAB_SMOKE": "1", "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter-config"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-workspaces")}
    log = open(tmp_path / "jupyterlab.log", "w")  # noqa: SIM115 - lives as long as the server, closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={workdir}",
         *(["--allow-root"] if os.geteuid() == 0 else [])],  # CI containers run as root
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_http(f"{base}/api/status?token={token}", proc, tmp_path / "jupyterlab.log")
        yield base, token, NOTEBOOK.name
    finally:
        if proc.poll() is None:  # the server and the kernels it started: one process group
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _gated(plot: list[dict]) -> list[float]:
    return next(t["y"] for t in plot if t["meta"] == "gated")


def test_tuner_plots_points_and_the_slider_moves_the_gated_curve(lab, tmp_path):
    base, token, name = lab
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(f"{base}/lab/tree/{name}?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle'], "
                                   "#jp-main-statusbar :text('Idle')", timeout=90_000)
            # Run > Run All Cells; retried once if no cell starts (a click that lands before the kernel
            # is connected is dropped).
            for _attempt in range(2):
                page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
                page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
                try:
                    page.wait_for_function(BUSY_JS, timeout=30_000)
                    break
                except sync_api.TimeoutError:
                    page.keyboard.press("Escape")

            # Every cell done (no "[*]" prompt) and the live tuner's plot holding its measured points.
            deadline = time.monotonic() + RUN_TIMEOUT_S
            plots: list = []
            while time.monotonic() < deadline:
                plots = page.evaluate(PLOTS_JS)
                measured = sum(len(t["x"]) for t in plots[0] if t["meta"].startswith("latency:")) if plots else 0
                if measured and len(plots) >= 2 and not page.evaluate(BUSY_JS):
                    break
                time.sleep(2)
            assert plots, "no plotly plot rendered"
            latency = [t for t in plots[0] if t["meta"].startswith("latency:")]
            assert sum(len(t["x"]) for t in latency) >= 6, f"latency plot has too few points: {latency}"
            assert not page.evaluate(BUSY_JS), f"notebook still running after {RUN_TIMEOUT_S} s"
            before = _gated(plots[0])
            assert before, "gated curve is empty"

            # Move the first tuner's slider to its minimum: SP + AsyncTP from 1 token on.
            handle = page.locator(".widget-slider .noUi-handle").first
            handle.scroll_into_view_if_needed()
            handle.focus()
            page.keyboard.press("Home")
            changed = None
            for _ in range(30):
                time.sleep(0.5)
                changed = _gated(page.evaluate(PLOTS_JS)[0])
                if changed != before:
                    break
            assert changed != before, f"moving the slider left the gated curve at {before}"

            no_news = page.locator(".jp-toast-button", has_text="No")  # JupyterLab's news prompt
            if no_news.count():
                no_news.first.click()
            tuner = page.locator(".jp-OutputArea-output .widget-vbox").first
            tuner.scroll_into_view_if_needed()
            artifacts = ROOT / "artifacts"
            artifacts.mkdir(exist_ok=True)
            tuner.screenshot(path=str(artifacts / "tuner.png"))
            if os.environ.get("SP_LAB_UPDATE_SCREENSHOT") == "1":
                (ROOT / "docs" / "img").mkdir(parents=True, exist_ok=True)
                shutil.copy(artifacts / "tuner.png", ROOT / "docs" / "img" / "tuner.png")
        finally:
            browser.close()
