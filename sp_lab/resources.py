"""Files shipped with the package: model presets and the measured H200 tables.

They live once, in the top-level ``data/`` of the repository, beside ``sp_lab/`` and ``notebooks/``; the wheel
carries them as the package data ``sp_lab/data`` (``pyproject.toml`` maps ``sp_lab.data`` to ``data/``). This
module is the one place that knows where they are, so a checkout, an editable install and a wheel all read
the same files:

- ``data/models/<name>.json``: Hugging Face ``config.json`` shape fields of a preset, with a ``_source``
  naming the public config the numbers come from.
- ``data/h200/``: tables measured on one NVIDIA H200 for this project (each file carries a ``meta`` block with
  device, torch, dtype, date and method; see ``docs/measured-h200.md``). GPU benchmarks write to ``$OUT``;
  their results are committed here.
- anything else under ``data/`` (a new table, a new folder) ships as it is: nothing else to declare.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["DATA_DIR", "H200_DIR", "PRESET_DIR", "h200_file", "load_preset", "preset_names"]


def _data_dir() -> Path:
    # A path (not importlib.resources' Traversable): polars and pyarrow need real files, and pip always unpacks
    # a wheel onto the file system. In a checkout (run from it, or installed editable) sp_lab/ sits beside
    # pyproject.toml and data/; an installed wheel has the files at sp_lab/data.
    package = Path(__file__).resolve().parent
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "data").is_dir():
        return checkout / "data"
    return package / "data"


DATA_DIR = _data_dir()
"""The data directory: ``data/`` of the checkout, or ``sp_lab/data`` of an installed wheel."""
PRESET_DIR = DATA_DIR / "models"
"""Preset model configs, ``data/models/*.json``."""
H200_DIR = DATA_DIR / "h200"
"""Tables measured on one H200, ``data/h200/``."""


def preset_names() -> list[str]:
    """Names of the shipped presets, sorted (``"toy"`` is built in code, not listed here)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_preset(name: str) -> dict:
    """The HF-style config dict of preset ``name``; ``ValueError`` naming the known presets otherwise."""
    path = PRESET_DIR / f"{name}.json"
    if "/" in name or not path.is_file():
        raise ValueError(f"unknown model preset {name!r}; shipped presets: {preset_names()}")
    return json.loads(path.read_text())


def h200_file(name: str) -> Path:
    """Path of the shipped H200 table ``name`` (e.g. ``"gemm_chunking_tp8.json"``); it may not exist
    for tables a GPU benchmark has not produced yet."""
    return H200_DIR / name
