"""A report as tables: one row per (range, piece), one row per range (polars DataFrames)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import polars as pl

from sp_lab.compiler.report import COLLECTIVE_KEYS, MATCH_KEYS
from sp_lab.viz.report_input import as_report

if TYPE_CHECKING:
    from sp_lab.viz.report_input import ReportSource

__all__ = ["piece_table", "range_table", "show_whole_tables"]


def piece_table(report: ReportSource) -> pl.DataFrame:
    """One row per (range, piece): matches per pass, op counts before/after, compile time, cache hit.

    Columns: range, lo, hi, boundary, piece, name, kind, op, compile_time_s, cache_hit,
    ``match_<key>`` for each MATCH_KEYS, ``before_<op>`` / ``after_<op>`` for each counted op,
    n_changed, fingerprint.
    """
    report = as_report(report)
    count_keys = sorted({k for r in report.ranges for p in r.pieces
                         for k in (*p.op_counts_before, *p.op_counts_after)}
                        | set(COLLECTIVE_KEYS), key=lambda k: (k not in COLLECTIVE_KEYS, k))
    rows = []
    for ri, r in enumerate(report.ranges):
        for p in r.pieces:
            row = {"range": ri, "lo": r.lo, "hi": r.hi, "boundary": r.boundary, "piece": p.index, "name": p.name,
                   "kind": p.kind, "op": p.op, "compile_time_s": p.compile_time_s, "cache_hit": p.cache_hit}
            row.update({f"match_{k}": p.matches.get(k, 0) for k in MATCH_KEYS})
            row.update({f"before_{k}": p.op_counts_before.get(k, 0) for k in count_keys})
            row.update({f"after_{k}": p.op_counts_after.get(k, 0) for k in count_keys})
            row.update(n_changed=len(p.changed), fingerprint=p.fingerprint)
            rows.append(row)
    schema = {"range": pl.Int64, "lo": pl.Int64, "hi": pl.Int64, "boundary": pl.String, "piece": pl.Int64,
              "name": pl.String, "kind": pl.String, "op": pl.String, "compile_time_s": pl.Float64,
              "cache_hit": pl.Boolean, **{f"match_{k}": pl.Int64 for k in MATCH_KEYS},
              **{f"before_{k}": pl.Int64 for k in count_keys}, **{f"after_{k}": pl.Int64 for k in count_keys},
              "n_changed": pl.Int64, "fingerprint": pl.String}
    return pl.DataFrame(rows, schema=schema)


def range_table(report: ReportSource) -> pl.DataFrame:
    """One row per compile range: token span (and the one token count of a graph Dynamo specialised), passes on,
    strategy, compiled, time, failures, safety."""
    report = as_report(report)
    return pl.DataFrame([{
        "range": i, "lo": r.lo, "hi": r.hi, "static_tokens": r.static_tokens, "enable_sp": bool(r.enable_sp),
        "enable_async_tp": bool(r.enable_async_tp),
        "boundary": r.boundary, "compile_mode": r.compile_mode, "compiled": bool(r.compiled),
        "compile_time_s": r.compile_time_s, "pieces": len(r.pieces), "failures": len(r.failures),
        "erased_copies": len(r.erased_copies), "numerically_unsafe": bool(r.numerically_unsafe),
    } for i, r in enumerate(report.ranges)], schema_overrides={"compile_time_s": pl.Float64, "static_tokens": pl.Int64})


def show_whole_tables() -> None:
    """Print polars tables whole in this process (every row and column, long strings): the notebooks' tables
    are small, and polars' defaults cut them at the right and hide the middle rows behind ``…``."""
    pl.Config.set_tbl_rows(-1)
    pl.Config.set_tbl_cols(-1)
    pl.Config.set_fmt_str_lengths(120)
    pl.Config.set_tbl_width_chars(400)
