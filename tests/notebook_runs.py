"""What every run of a notebook in the suite must show, whether nbclient ran it or JupyterLab's Run All did.

Notebooks 2 and 3 run top to bottom in a real JupyterLab in the browser tests (``tests/browser/``), which save
the executed copy and record it here. ``tests/test_notebooks.py`` then checks that run instead of executing
the notebook a second time with nbclient: the same checks, one run less (each is a compile-heavy minute on
2 cores). Run alone, or when the browser tests did not run, ``test_notebooks.py`` executes it itself.
"""

from __future__ import annotations

import re
from typing import Any

SP_LAB_WARNING = re.compile(r"sp_lab/\S+\.py:\d+: \w*Warning:")
"""A warning raised at a line of sp_lab (e.g. a deprecated torch API it calls): it prints into every notebook
that runs that line, between progress bars, as an error-like block."""

RUN_IN_JUPYTERLAB: dict[str, Any] = {}
"""Notebook file name -> its executed copy (an ``nbformat`` notebook), saved by a browser test after Run All."""


def _code_cells(nb: Any) -> list[tuple[int, Any]]:
    return [(i, cell) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"]


def not_run(nb: Any) -> list[int]:
    """Indices of the code cells that did not run (JupyterLab never runs an empty cell: those do not count)."""
    return [i for i, cell in _code_cells(nb) if cell.execution_count is None and cell.source.strip()]


def errors(nb: Any) -> list[str]:
    """Code cells that did not run, and the errors cells raised (``Name: value``), by cell index."""
    raised = [f"cell {i} raised {out.get('ename')}: {out.get('evalue')}"
              for i, cell in _code_cells(nb) for out in cell.outputs if out.get("output_type") == "error"]
    return [f"cell {i} did not run" for i in not_run(nb)] + raised


def sp_lab_warnings(nb: Any) -> list[str]:
    """Warning lines that point at sp_lab's own code, in any cell's stderr (each once)."""
    return sorted({line.strip() for _, cell in _code_cells(nb) for out in cell.outputs
                   if out.get("name") == "stderr" for line in out.get("text", "").splitlines()
                   if SP_LAB_WARNING.search(line)})


def assert_ran_cleanly(nb: Any, name: str) -> None:
    """Every cell of a run in JupyterLab ran, none raised, and sp_lab's own code never warned."""
    assert not errors(nb), f"{name} failed in JupyterLab: {errors(nb)}"
    warned = sp_lab_warnings(nb)
    assert not warned, f"{name}: sp_lab's own code warns (run in JupyterLab):\n" + "\n".join(warned)
