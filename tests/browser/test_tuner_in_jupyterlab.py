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
import shutil
import subprocess
import sys
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
    require_browser,
    run_all_cells,
    save_and_record,
    serve_notebook,
    sync_api,
)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "03_tune_async_tp_min_tokens.ipynb"
RUN_TIMEOUT_S = 420

pytestmark = [pytest.mark.notebooks]

# Plotly keeps each figure's traces on its graph div (gd.data); FigureWidget renders into one too.
PLOTS_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(el =>
    (el.data || []).map(t => ({name: t.name || '', meta: String(t.meta || ''),
                              x: Array.from(t.x || []), y: Array.from(t.y || [])})))"""


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab serving a copy of notebook 3 (``jupyterlab_session.Served``)."""
    require_browser()
    with serve_notebook(NOTEBOOK, tmp_path) as served:
        yield served


STARTED_JS = """() => Array.from(document.querySelectorAll('.jp-InputArea-prompt'))
    .some(el => /[0-9*]/.test(el.textContent))"""

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


def _shoot(page, name: str) -> None:
    """The first tuner, whole, to ``artifacts/<name>`` (and ``docs/img/`` with ``SP_LAB_UPDATE_SCREENSHOT=1``)."""
    tuner = page.locator(".jp-OutputArea-output .widget-vbox").first
    tuner.evaluate("el => el.scrollIntoView({block: 'center'})")
    time.sleep(1)
    artifacts = ROOT / "artifacts"
    artifacts.mkdir(exist_ok=True)
    tuner.screenshot(path=str(artifacts / name))
    if os.environ.get("SP_LAB_UPDATE_SCREENSHOT") == "1":
        (ROOT / "docs" / "img").mkdir(parents=True, exist_ok=True)
        shutil.copy(artifacts / name, ROOT / "docs" / "img" / name)


def test_tuner_plots_points_and_the_slider_moves_the_gated_curve(lab, tmp_path):
    base, token, name = lab.base, lab.token, lab.name
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 2600})  # the whole tuner in view
            dialogs = Dialogs(page)
            # on failure: a screenshot, the dialogs met, the browser console's errors, the server log
            with failure_record(page, "tuner", tmp_path / "jupyterlab.log", dialogs):
                page.goto(f"{base}/lab/tree/{name}?token={token}")
                run_all_cells(page, dialogs)
                for _ in range(3):  # on a loaded machine the Run All click can land before the kernel listens
                    if page.evaluate(STARTED_JS):
                        break
                    time.sleep(5)
                    run_all_cells(page, dialogs)
                assert page.evaluate(STARTED_JS), "Run > Run All Cells started no cell (4 attempts)"

                # Points appear while the sweep runs (some, not yet all), then every cell ends (no "[*]").
                deadline = time.monotonic() + RUN_TIMEOUT_S
                plots: list = []
                during: list[int] = []
                streamed = False
                while time.monotonic() < deadline:
                    plots = page.evaluate(PLOTS_JS)
                    measured = sum(len(t["x"]) for t in plots[0] if t["meta"].startswith("latency:")) if plots else 0
                    busy = page.evaluate(BUSY_JS)
                    if busy and measured:
                        if not streamed:  # the first points of the live sweep: the "streaming" screenshot
                            _shoot(page, "tuner_streaming.png")
                            streamed = True
                        during.append(measured)
                    if measured and len(plots) >= 2 and not busy:
                        break
                    time.sleep(0.5)
                assert plots, "no plotly plot rendered"
                latency = [t for t in plots[0] if t["meta"].startswith("latency:")]
                final = sum(len(t["x"]) for t in latency)
                assert final >= 6, f"latency plot has too few points: {latency}"
                assert not page.evaluate(BUSY_JS), f"notebook still running after {RUN_TIMEOUT_S} s"
                save_and_record(page, lab)  # every cell ran, none raised: test_notebooks.py checks this run
                assert during and min(during) < final, (
                    f"no partial plot seen while the sweep ran (point counts seen while busy: {during}, final {final})")
                # Drawn, not only given data: every live plot (the live tuner's and the replay's) has SVG traces.
                drawn = [p for p in page.evaluate(DRAWN_JS) if p["live"]]
                assert len(drawn) >= 2 and all(p["traces"] > 0 and p["paths"] > 0 for p in drawn), (
                    f"a live plot on the page is blank: {drawn}")

                # Slider to its first value (the policy's upper variant from the smallest token count on),
                # then to "never"; each time the curve must be what the selected policy runs at each count.
                handle = page.locator(".widget-slider .noUi-handle").first
                handle.scroll_into_view_if_needed()
                for key, wanted in (("Home", None), ("End", "never")):
                    handle.focus()
                    page.keyboard.press(key)
                    ok, plot, selected = False, [], {}
                    for _ in range(120):  # the kernel answers the slider; on a loaded machine that can take a while
                        time.sleep(0.5)
                        plot, selected = page.evaluate(PLOTS_JS)[0], page.evaluate(SELECTED_JS)
                        if (wanted is None or selected["threshold"] == wanted) and "->" in str(selected["policy"]):
                            got, want = _gated(plot), _expected(plot, selected)
                            ok = got.keys() == want.keys() and all(abs(got[x] - want[x]) < 1e-6 for x in got)
                            if ok:
                                break
                    assert ok, f"after {key}: the curve {_gated(plot)} is not what {selected} runs: {_expected(plot, selected)}"

                page.add_style_tag(content=".Toastify, .jp-toast-container {display: none !important}")
                _shoot(page, "tuner.png")

                # The sweep's HTML report of the rows this notebook measured (the store is the notebook's, under
                # SP_LAB_OUT): every plot in it drawn, and its screenshot for the README.
                report = tmp_path / "out" / "report.html"
                made = subprocess.run([sys.executable, "-m", "sp_lab", "report", "--store",
                                       str(tmp_path / "out" / "sweeps"), "--out", str(report)],
                                      check=False, capture_output=True, text=True, timeout=300)
                assert made.returncode == 0, made.stderr
                page.set_viewport_size({"width": 1250, "height": 1400})
                page.goto(report.as_uri())
                page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot .scatterlayer .trace').length"
                                       " > 0", timeout=60_000)
                drawn = page.evaluate(DRAWN_JS)
                assert drawn and all(p["traces"] > 0 for p in drawn), f"a plot of the report is blank: {drawn}"
                artifacts = ROOT / "artifacts"
                page.screenshot(path=str(artifacts / "report.png"), full_page=False)
                if os.environ.get("SP_LAB_UPDATE_SCREENSHOT") == "1":
                    shutil.copy(artifacts / "report.png", ROOT / "docs" / "img" / "report.png")
        finally:
            browser.close()
