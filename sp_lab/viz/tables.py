"""A report as tables: one row per (range, piece), one row per range (polars DataFrames)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import polars as pl

from sp_lab.compiler.report import COLLECTIVE_KEYS, MATCH_KEYS
from sp_lab.viz.report_input import as_report

if TYPE_CHECKING:
    from sp_lab.viz.report_input import ReportSource

__all__ = ["NOTEBOOK_CHARS", "compact", "piece_table", "range_table", "show_whole_tables"]

NOTEBOOK_CHARS = 115
"""About what a notebook's output area shows of a table without cutting it at the right, in characters of polars'
text form (its HTML form in JupyterLab is about as wide: some 830 px at 13 px)."""

# The long column names of the tables, as the explorer's figures abbreviate them (OP_ABBREVIATIONS for the ops).
_SHORT = {"num_tokens": "tokens", "enable_sp": "SP", "enable_async_tp": "AsyncTP", "compile_time_s": "compile s",
          "static_tokens": "static N", "compile_mode": "mode", "erased_copies": "erased", "numerically_unsafe": "unsafe",
          "sp_rewrites": "SP rewrites", "fusion_fired": "fused", "match_sp_first": "SP first",
          "match_sp_middle": "SP middle", "match_sp_last": "SP last", "match_async_tp_ag_mm": "AG+mm",
          "match_async_tp_mm_rs": "mm+RS", "cache_hit": "cached"}


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


def compact(table: pl.DataFrame, *, digits: int = 2) -> pl.DataFrame:
    """``table`` as a notebook shows it whole: long column names shortened (``enable_async_tp`` -> ``AsyncTP``,
    ``fused_all_gather_matmul`` -> ``AG+mm``, ``match_sp_first`` -> ``SP first``) and floats rounded to ``digits``.
    Any sp_lab table (:func:`piece_table`, :func:`range_table`, op counts by token count); other columns keep
    their names."""
    from sp_lab.viz.overview import OP_ABBREVIATIONS

    short = {**_SHORT, **{str(k): v for k, v in OP_ABBREVIATIONS.items()}}
    floats = [c for c, t in table.schema.items() if t.is_float()]
    return table.with_columns(pl.col(floats).round(digits)).rename({c: short[c] for c in table.columns if c in short})

