"""Files shipped inside the package: model presets and the measured H200 tables.

Everything sp_lab reads at run time lives under ``sp_lab/data/`` so a plain (non-editable)
``pip install`` carries it; this module is the one place that knows where that is.

- ``sp_lab/data/models/<name>.json``: Hugging Face ``config.json`` shape fields of a preset, with a
  ``_source`` naming the public config the numbers come from.
- ``sp_lab/data/h200/``: tables measured on one NVIDIA H200 for this project (each file carries a
  ``meta`` block with device, torch, dtype, date and method; see ``docs/measured-h200.md``).
  GPU benchmarks write to ``$OUT``; their results are committed here.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["DATA_DIR", "H200_DIR", "PRESET_DIR", "h200_file", "load_preset", "preset_names"]

# A path relative to the package (not importlib.resources' Traversable): polars and pyarrow need real
# file paths, and pip always unpacks a wheel onto the file system.
DATA_DIR = Path(__file__).resolve().parent / "data"
"""The package's data directory, ``sp_lab/data``."""
PRESET_DIR = DATA_DIR / "models"
"""Preset model configs, ``sp_lab/data/models/*.json``."""
H200_DIR = DATA_DIR / "h200"
"""Tables measured on one H200, ``sp_lab/data/h200/``."""


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
