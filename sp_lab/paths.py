"""Where sp_lab reads and writes by default: one ``out/`` folder per project, wherever the code runs from.

The CLI (run from the checkout), ``make run`` and the notebooks (whose kernel runs in ``notebooks/``) must meet in
one store. So the default folder is anchored at the *project*, not at the working directory: the nearest
directory at or above the working directory that holds a ``pyproject.toml`` or a ``.git``, else the working
directory itself. ``SP_LAB_OUT`` names another folder outright (the tests use it to keep the checkout clean).
The layout inside it (``sweeps/``, ``report.html``) is :mod:`sp_lab.vocabulary`'s.
"""

from __future__ import annotations

import os
from pathlib import Path

from sp_lab.vocabulary import DEFAULT_OUT, DEFAULT_REPORT, DEFAULT_STORE

OUT_ENV = "SP_LAB_OUT"
"""Environment variable naming the output folder (overrides the project's ``out/``)."""

__all__ = ["OUT_ENV", "default_out", "default_report", "default_store", "project_root", "resolve_in_project"]


def project_root(start: str | Path | None = None) -> Path:
    """The nearest directory at or above ``start`` (default: the working directory) with a ``pyproject.toml``
    or a ``.git``; ``start`` itself when there is none."""
    here = Path(start if start is not None else Path.cwd()).resolve()
    for directory in (here, *here.parents):
        if (directory / "pyproject.toml").is_file() or (directory / ".git").exists():
            return directory
    return here


def default_out() -> Path:
    """The output folder every command, notebook and widget uses unless told otherwise (absolute)."""
    named = os.environ.get(OUT_ENV)
    return Path(named).expanduser().resolve() if named else project_root() / DEFAULT_OUT


def default_store() -> Path:
    """The sweep store inside :func:`default_out`."""
    return default_out() / Path(DEFAULT_STORE).relative_to(DEFAULT_OUT)


def default_report() -> Path:
    """The HTML report's path inside :func:`default_out`."""
    return default_out() / Path(DEFAULT_REPORT).relative_to(DEFAULT_OUT)


def resolve_in_project(path: str | Path) -> Path:
    """``path`` as given when it exists (or is absolute), else relative to :func:`project_root` when it exists
    there: ``"out/sweeps"`` typed in a notebook whose kernel runs in ``notebooks/`` means the project's."""
    given = Path(path).expanduser()
    if given.is_absolute() or given.exists():
        return given
    anchored = project_root() / given
    return anchored if anchored.exists() else given
