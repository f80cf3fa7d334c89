"""Every notebook runs top to bottom, headless, on CPU, with the smoke setting (``SP_LAB_SMOKE=1``).

Each notebook is executed with nbclient in a fresh ``python3`` kernel whose working directory is
``notebooks/`` (as in JupyterLab). A failing cell fails the test with that cell's error. The
notebooks share the Inductor cache of the run (``TORCHINDUCTOR_CACHE_DIR``), so repeated compiles of
the same toy graphs are cheap. A notebook a browser test already ran in JupyterLab in this session
(``tests/notebook_runs.py``) is checked on that run, with the same checks, instead of running twice.
Deselect with ``-m "not notebooks"``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import notebook_runs
import pytest
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel", reason="the notebooks need a python3 kernel (pip install ipykernel)")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 300
"""A cell that runs a sweep or a compile on 2 ranks takes under a minute on 2 cores in smoke mode."""

pytestmark = pytest.mark.notebooks


def test_notebooks_exist():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    with_outputs = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not with_outputs, f"{path.name}: cells {with_outputs} carry outputs; clear them before committing"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_smoke_mode(path, monkeypatch, tmp_path):
    ran = notebook_runs.RUN_IN_JUPYTERLAB.get(path.name)
    if ran is not None:  # Run All in JupyterLab, smoke setting on, saved by its browser test
        notebook_runs.assert_ran_cleanly(ran, path.name)
        print(f"{path.name}: checked on its run in JupyterLab (tests/browser/)")
        return
    # The kernel inherits this environment: smoke setting on, the run's Inductor cache shared, a fresh output
    # folder instead of the checkout's out/ (the notebooks write where the CLI does: sp_lab.paths), and a
    # temporary directory of its own, which the notebook must leave empty once its kernel has shut down.
    monkeypatch.setenv("SP_LAB_SMOKE", "1")
    monkeypatch.setenv("SP_LAB_OUT", str(tmp_path / "out"))
    kernel_tmp = tmp_path / "tmp"
    kernel_tmp.mkdir()
    # Inductor keeps its precompiled C++ headers (about 130 MB, several seconds of g++ each) under
    # $TMPDIR/torchinductor_<user> even where TORCHINDUCTOR_CACHE_DIR is set: the kernel's own TMPDIR links
    # to the run's, so the notebook builds none of them again.
    inductor_tmp = Path(default_cache_dir())  # Inductor's own choice of name (the user's, or uid_<n> without one)
    inductor_tmp.mkdir(exist_ok=True)
    (kernel_tmp / inductor_tmp.name).symlink_to(inductor_tmp, target_is_directory=True)
    monkeypatch.setenv("TMPDIR", str(kernel_tmp))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    start = time.perf_counter()
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name} failed in smoke mode:\n{e}", pytrace=False)
    warned = notebook_runs.sp_lab_warnings(nb)
    assert not warned, f"{path.name}: sp_lab's own code warns:\n" + "\n".join(warned)
    left = sorted(p.name for p in kernel_tmp.iterdir() if p.name != inductor_tmp.name)  # all but the link above
    assert not left, f"{path.name} left temporary files behind after its kernel shut down: {left}"
    print(f"{path.name}: {time.perf_counter() - start:.1f} s (SP_LAB_SMOKE=1, {os.cpu_count()} CPUs)")
