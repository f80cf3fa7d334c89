"""What the browser tests share: a JupyterLab serving a copy of one notebook, headless Chromium, Run All.

JupyterLab listens on 127.0.0.1 with a random port and token and serves a copy of the notebook under
``.cache/`` (so the UI's autosave never writes outputs into the committed notebook). Browsers are never
downloaded: Playwright drives the system's Chromium.
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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


@contextmanager
def serve_notebook(notebook: Path, tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """(base URL, token, notebook name) of a JupyterLab serving a copy of ``notebook``; stopped on exit."""
    workdir = ROOT / ".cache" / f"browser-{secrets.token_hex(4)}"  # under the repo: the notebook finds ROOT
    workdir.mkdir(parents=True)
    shutil.copy(notebook, workdir / notebook.name)
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "SP_LAB_SMOKE": "1", "JUPYTER_CONFIG_DIR": str(tmp_path / "jupyter-config"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-workspaces")}
    # Render every cell: JupyterLab 4 leaves cells out of the page until they are scrolled to ("windowing"),
    # and a test reads outputs far down the notebook.
    settings = tmp_path / "lab-settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text('{"windowingMode": "none"}')
    log_path = tmp_path / "jupyterlab.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={port}", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={workdir}",
             *(["--allow-root"] if os.geteuid() == 0 else [])],  # CI containers run as root
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            _wait_http(f"{base}/api/status?token={token}", proc, log_path)
            yield base, token, notebook.name
        finally:
            if proc.poll() is None:  # the server and the kernels it started: one process group
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            shutil.rmtree(workdir, ignore_errors=True)


def run_all_cells(page) -> None:
    """Wait for the notebook and its kernel, then Run > Run All Cells; retried once if no cell starts (a click
    that lands before the kernel is connected is dropped)."""
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle'], "
                           "#jp-main-statusbar :text('Idle')", timeout=90_000)
    for _attempt in range(2):
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        try:
            page.wait_for_function(BUSY_JS, timeout=30_000)
            return
        except sync_api.TimeoutError:
            page.keyboard.press("Escape")
