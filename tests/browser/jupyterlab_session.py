"""What the browser tests share: a JupyterLab serving a copy of one notebook, headless Chromium, Run All.

JupyterLab listens on 127.0.0.1 with a random port and token and serves a copy of the notebook under
``.cache/`` (so the UI's autosave never writes outputs into the committed notebook). Browsers are never
downloaded: Playwright drives the system's Chromium.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import notebook_runs
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
IN_CI = bool(os.environ.get("CI"))
# A cell still running shows "[*]" as its prompt.
BUSY_JS = """() => Array.from(document.querySelectorAll('.jp-InputArea-prompt'))
    .some(el => el.textContent.includes('*'))"""

try:
    from playwright import sync_api
except ImportError:
    sync_api = None


def missing(reason: str) -> None:
    """Skip on a workstation; fail in CI, where the image is supposed to have everything."""
    if IN_CI:
        pytest.fail(f"{reason} (CI is set: the browser test must run here)", pytrace=False)
    pytest.skip(reason)


def require_browser() -> None:
    """Playwright and Chromium, or a skip (a failure under CI) saying which is missing."""
    if sync_api is None:
        missing("pip install playwright (its browsers are not needed)")
    if CHROMIUM is None:
        missing("no chromium on PATH (apt-get install -y chromium)")


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


class Served(NamedTuple):
    """A JupyterLab serving a copy of one notebook."""

    base: str
    """its URL, ``http://127.0.0.1:<port>``"""
    token: str
    name: str
    """the notebook's file name"""
    copy: Path
    """the copy it serves (and saves to)"""


@contextmanager
def serve_notebook(notebook: Path, tmp_path: Path) -> Iterator[Served]:
    """A JupyterLab serving a copy of ``notebook``; stopped on exit."""
    workdir = ROOT / ".cache" / f"browser-{secrets.token_hex(4)}"  # under the repo: the notebook finds ROOT
    workdir.mkdir(parents=True)
    shutil.copy(notebook, workdir / notebook.name)
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "SP_LAB_SMOKE": "1", "SP_LAB_OUT": str(tmp_path / "out"), "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter-config"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-workspaces")}
    # Render every cell: JupyterLab 4 leaves cells out of the page until they are scrolled to ("windowing"),
    # and a test reads outputs far down the notebook.
    settings = tmp_path / "lab-settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text('{"windowingMode": "none"}')
    # no "receive official Jupyter news?" toast over the widgets (and their screenshots)
    news = tmp_path / "lab-settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True, exist_ok=True)
    news.write_text('{"fetchNews": "false", "checkForUpdates": false}')
    log_path = tmp_path / "jupyterlab.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={workdir}",
             # window.jupyterapp: run_all_cells asks the notebook's own session whether its kernel is ready
             "--LabApp.expose_app_in_browser=True",
             *(["--allow-root"] if os.geteuid() == 0 else [])],  # CI containers run as root
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_http(f"{base}/api/status?token={token}", proc, log_path)
            yield Served(base, token, notebook.name, workdir / notebook.name)
        finally:
            if proc.poll() is None:  # the server and the kernels it started: one process group
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            shutil.rmtree(workdir, ignore_errors=True)


# Every drawn plotly plot on the page (LiveFigure views and any other plotly div): the SVG plotly.js really drew,
# not the data it was given. A blank plot (empty axes) has no trace groups and no path with a non-empty "d".
DRAWN_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(el => ({
    live: !!el.closest('.sp-lab-live-figure') || el.classList.contains('sp-lab-live-figure'),
    traces: el.querySelectorAll('.scatterlayer .trace').length,
    paths: Array.from(el.querySelectorAll('.scatterlayer .trace path'))
        .filter(p => (p.getAttribute('d') || '').length > 2).length,
    points: el.querySelectorAll('.scatterlayer .trace .point, .scatterlayer .trace .textpoint').length,
    title: String(((el.layout || {}).title || {}).text || '')}))"""

DIALOG_JS = """() => Array.from(document.querySelectorAll('.jp-Dialog')).map(d =>
    (d.querySelector('.jp-Dialog-header')?.textContent || '') + ': ' +
    (d.querySelector('.jp-Dialog-body')?.textContent || '').trim().slice(0, 500))"""


class Dialogs:
    """JupyterLab's modal dialogs (``jp-Dialog``) met on the way: each one's text, and how it was answered.

    A dialog over the notebook intercepts every click; :meth:`dismiss` answers it with its reject button
    (or Escape) and records the text, so a failure report can say which dialog it was.
    """

    def __init__(self, page) -> None:
        self.page = page
        self.seen: list[str] = []

    ACCEPT = ("Select Kernel",)
    """Dialogs whose right answer is their accept button: "Select Kernel" (a loaded machine's JupyterLab can ask
    before its kernel list arrives) preselects the notebook's own kernel; its reject button means no kernel."""

    def dismiss(self) -> None:
        """Answer every open dialog (accept for :attr:`ACCEPT`, else reject, else Escape), recording its text."""
        for _ in range(8):
            texts = self.page.evaluate(DIALOG_JS)
            if not texts:
                return
            self.seen.extend(texts)
            accept = texts[-1].startswith(self.ACCEPT)
            button = self.page.locator(f".jp-Dialog {'.jp-mod-accept' if accept else '.jp-mod-reject'}")
            if button.count():
                button.last.click()
            else:
                self.page.keyboard.press("Escape")
            time.sleep(0.5)

    def accept(self, timeout_s: float = 20.0) -> None:
        """Wait for a dialog and press its accept button (e.g. "Restart" after Kernel > Restart)."""
        self.page.wait_for_selector(".jp-Dialog .jp-mod-accept", timeout=timeout_s * 1000)
        self.seen.extend(self.page.evaluate(DIALOG_JS))
        self.page.locator(".jp-Dialog .jp-mod-accept").first.click()


@contextmanager
def failure_record(page, name: str, log_path: Path, dialogs: Dialogs) -> Iterator[None]:
    """On any failure inside: a full-page screenshot and the page's text state under ``artifacts/``, and the
    error re-raised with the dialogs seen (and any still open), the browser console's errors and the server log."""
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    try:
        yield
    except Exception as failure:
        artifacts = ROOT / "artifacts"
        artifacts.mkdir(exist_ok=True)
        shot = artifacts / f"{name}_failure.png"
        try:
            open_dialogs = page.evaluate(DIALOG_JS)
            page.screenshot(path=str(shot), full_page=True)
            drawn = page.evaluate(DRAWN_JS)
        except Exception as e:  # noqa: BLE001 - the page itself may be gone; report the original failure
            open_dialogs, drawn = [f"(page unreadable: {e})"], []
        (artifacts / f"{name}_failure.json").write_text(json.dumps(
            {"dialogs_open": open_dialogs, "dialogs_seen": dialogs.seen, "plots": drawn, "console_errors": errors},
            indent=1))
        log = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else "(no log)"
        raise AssertionError(
            f"{failure}\n(screenshot {shot}; dialogs open: {open_dialogs}; dialogs dismissed: {dialogs.seen}; "
            f"console errors: {errors[-10:]}; plots drawn: {drawn}\nJupyterLab log tail:\n{log})") from failure


# The current notebook's kernel, as its own session sees it: "idle" once connected and ready for cells.
KERNEL_STATE_JS = """() => { const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const kernel = panel && panel.sessionContext && panel.sessionContext.session && panel.sessionContext.session.kernel;
    return kernel ? kernel.connectionStatus + ':' + kernel.status : 'no kernel'; }"""
# Not awaited: the command's promise resolves only when every cell has run.
RUN_ALL_JS = "() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); return true; }"


def run_all_cells(page, dialogs: Dialogs | None = None) -> None:
    """Wait until the notebook's kernel is connected and idle, then run every cell through JupyterLab's own
    ``notebook:run-all-cells`` command; retried once if no cell starts. Dialogs in the way are answered and
    recorded.

    The command, not the Run menu: a menu click can land on a dialog or before the session is connected, and a
    kernel that is not connected yet drops the cells (their prompts stay "[*]" while the kernel idles)."""
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    dialogs = dialogs or Dialogs(page)
    for _attempt in range(2):
        deadline = time.monotonic() + 90
        state = page.evaluate(KERNEL_STATE_JS)
        while state != "connected:idle":
            dialogs.dismiss()  # a "Select Kernel" dialog would keep the kernel from starting
            if time.monotonic() > deadline:
                raise TimeoutError(f"the notebook's kernel was not ready within 90 s: {state} "
                                   f"(dialogs answered: {dialogs.seen})")
            time.sleep(0.5)
            state = page.evaluate(KERNEL_STATE_JS)
        page.evaluate(RUN_ALL_JS)
        try:
            page.wait_for_function(BUSY_JS, timeout=30_000)
            return
        except sync_api.TimeoutError:
            dialogs.dismiss()


SAVE_JS = "() => { window.jupyterapp.commands.execute('docmanager:save'); return true; }"


def save_and_record(page, served: Served, timeout_s: float = 60.0) -> None:
    """Save the notebook from the page (JupyterLab's own ``docmanager:save``) once every cell has run, and record
    the executed copy for ``tests/test_notebooks.py`` (``tests/notebook_runs.py``), which checks it instead of
    running the notebook again. Asserts what that test asserts: every cell ran, none raised, sp_lab never warned."""
    import nbformat

    deadline = time.monotonic() + timeout_s
    saved = None
    while time.monotonic() < deadline:
        page.evaluate(SAVE_JS)
        time.sleep(1.0)
        try:
            nb = nbformat.read(served.copy, as_version=4)
        except (OSError, ValueError):  # mid-write
            continue
        if not notebook_runs.not_run(nb):
            saved = nb
            break
    assert saved is not None, f"the executed {served.name} was not saved with every cell run within {timeout_s:.0f} s"
    notebook_runs.assert_ran_cleanly(saved, served.name)
    notebook_runs.RUN_IN_JUPYTERLAB[served.name] = saved
