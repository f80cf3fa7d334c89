"""Tuning: the one regret, policies over baseline / sp / sp+async_tp, exported configs, per-matmul rules.

``sp_lab.tuning.regret_table(rows, config)`` is the regret every view shows (see :mod:`sp_lab.tuning.regret`);
:func:`sp_lab.tuning.policy.recommend` chooses a policy with the rows' noise in mind.

``regret_table`` is imported on first use, not here: :mod:`sp_lab.tuning.microbench` (torch only) must import
on a GPU machine without polars (``benchmarks/bench_matmul_h200.py``), and importing it runs this file.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sp_lab.tuning.regret import regret_table

__all__ = ["regret_table"]


def __getattr__(name: str) -> Any:
    if name == "regret_table":
        return import_module("sp_lab.tuning.regret").regret_table
    raise AttributeError(f"module 'sp_lab.tuning' has no attribute {name!r}")
