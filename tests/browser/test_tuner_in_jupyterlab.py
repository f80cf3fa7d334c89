"""Notebook 3 in a real JupyterLab, driven by headless Chromium (Debian's ``chromium`` + Playwright).

JupyterLab is started on 127.0.0.1 with a random port and token, on a copy of
``notebooks/03_tune_async_tp_min_tokens.ipynb`` under ``.cache/`` (so the UI's autosave never writes
outputs into the committed notebook). The test runs every cell from the Run menu with the smoke
setting, then asserts on what the browser shows:

1. measured points appear in the tuner's latency plot while the sweep is still running, and all of them
   are there once it ends (plotly trace data read from the DOM);
2. after moving the ``async_tp_min_tokens`` slider (to its first value, then to "never"), the config's
   curve is, at every token count, the latency of the variant the selected policy runs there.

A screenshot of the tuner goes to ``artifacts/tuner.png`` (and to ``docs/img/tuner.png`` when
``SP_LAB_UPDATE_SCREENSHOT=1``). Without chromium or the playwright package the test is skipped with the
reason on a workstation and **fails** under CI (``CI`` set): a CI image that lost them must not pass
silently. Browsers are never downloaded (``playwright install`` is not used).
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

IN_CI = bool(os.environ.get("CI"))


def _missing(reason: str) -> None:
    """Skip on a workstation; fail in CI, where the image is supposed to have everything."""
    if IN_CI:
        pytest.fail(f"{reason} (CI is set: the browser test must run here)", pytrace=False)
    pytest.skip(reason)


try:
    from playwright import sync_api
except ImportError:
    sync_api = None

pytestmark = [pytest.mark.notebooks]

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
    if sync_api is None:
        _missing("pip install playwright (its browsers are not needed)")
    if CHROMIUM is None:
        _missing("no chromium on PATH (apt-get install -y chromium)")
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


# The first tuner's policy dropdown and threshold slider, found by their labels.
SELECTED_JS = """() => {
    const labelled = (cls, text) => Array.from(document.querySelectorAll(cls))
        .find(el => el.querySelector('label')?.textContent.trim() === text);
    const select = labelled('.widget-dropdown', 'policy')?.querySelector('select');
    return {threshold: labelled('.widget-slider', 'async_tp_min_tokens')?.querySelector('.widget-readout')
                           ?.textContent.trim(),
            policy: select ? select.options[select.selectedIndex].textContent.trim() : undefined};
}"""


def _gated(plot: list[dict]) -> dict[int, float]:
    trace = next(t for t in plot if t["meta"] == "gated")
    return dict(zip(trace["x"], trace["y"], strict=True))


def _expected(plot: list[dict], selected: dict) -> dict[int, float]:
    """At each token count, the latency of the variant the selected policy runs there (from the plot's traces)."""
    below, above = (v.strip() for v in selected["policy"].split("->"))
    latency = {t["meta"].removeprefix("latency:"): dict(zip(t["x"], t["y"], strict=True))
               for t in plot if t["meta"].startswith("latency:")}
    threshold = selected["threshold"]
    runs = {x: below if threshold == "never" or x < int(threshold) else above for x in _gated(plot)}
    return {x: latency[v][x] for x, v in runs.items()}




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

            # Points appear while the sweep runs (some, not yet all), then every cell ends (no "[*]").
            deadline = time.monotonic() + RUN_TIMEOUT_S
            plots: list = []
            during: list[int] = []
            while time.monotonic() < deadline:
                plots = page.evaluate(PLOTS_JS)
                measured = sum(len(t["x"]) for t in plots[0] if t["meta"].startswith("latency:")) if plots else 0
                busy = page.evaluate(BUSY_JS)
                if busy and measured:
                    during.append(measured)
                if measured and len(plots) >= 2 and not busy:
                    break
                time.sleep(0.5)
            assert plots, "no plotly plot rendered"
            latency = [t for t in plots[0] if t["meta"].startswith("latency:")]
            final = sum(len(t["x"]) for t in latency)
            assert final >= 6, f"latency plot has too few points: {latency}"
            assert not page.evaluate(BUSY_JS), f"notebook still running after {RUN_TIMEOUT_S} s"
            assert during and min(during) < final, (
                f"no partial plot seen while the sweep ran (point counts seen while busy: {during}, final {final})")

            # Slider to its first value (the policy's upper variant from the smallest token count on),
            # then to "never"; each time the curve must be what the selected policy runs at each count.
            handle = page.locator(".widget-slider .noUi-handle").first
            handle.scroll_into_view_if_needed()
            for key, wanted in (("Home", None), ("End", "never")):
                handle.focus()
                page.keyboard.press(key)
                ok, plot, selected = False, [], {}
                for _ in range(40):
                    time.sleep(0.5)
                    plot, selected = page.evaluate(PLOTS_JS)[0], page.evaluate(SELECTED_JS)
                    if (wanted is None or selected["threshold"] == wanted) and "->" in str(selected["policy"]):
                        got, want = _gated(plot), _expected(plot, selected)
                        ok = got.keys() == want.keys() and all(abs(got[x] - want[x]) < 1e-6 for x in got)
                        if ok:
                            break
                assert ok, f"after {key}: the curve {_gated(plot)} is not what {selected} runs: {_expected(plot, selected)}"

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
