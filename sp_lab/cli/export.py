"""``export``: write the tuned config file (one JSON per device / tp / model / dtype, with provenance)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from sp_lab.cli import rows
from sp_lab.cli.arguments import add_filter_args, add_vllm_arg, threshold
from sp_lab.cli.errors import CliError
from sp_lab.vocabulary import DEFAULT_OUT

if TYPE_CHECKING:
    import polars as pl

HELP = "write the tuned config file (from --threshold or the recommendation)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_filter_args(p)
    p.add_argument("--config", type=Path, default=None, help="base LabConfig JSON (default: LabConfig())")
    p.add_argument("--threshold", type=threshold, default=argparse.SUPPRESS,
                   help="baseline below, sp+async_tp from this token count; 'never' for SP and AsyncTP off "
                   "(default: the recommended policy)")
    p.add_argument("--out", type=Path, default=None, help=f"directory for the file (default {DEFAULT_OUT}/ in the project)")
    p.add_argument("--matmul-rows", type=Path, default=None,
                   help="per-matmul fused/unfused rows (.parquet or .csv, as measure_matmuls writes them) for the "
                   "model-level gates per shape (default: the layer sweep's gate for every matmul)")
    add_vllm_arg(p)


def run(args: argparse.Namespace) -> int:
    from sp_lab.programs import Policy
    from sp_lab.tuning.export import describe_file
    from sp_lab.vocabulary import BASELINE, SP_ASYNC_TP

    df = rows.tuning_rows(args)
    base = rows.base_config(args, df)
    rec = None
    if hasattr(args, "threshold"):
        if args.threshold is not None and args.threshold > base.max_num_tokens:
            raise CliError(f"--threshold {args.threshold} is above max_num_tokens={base.max_num_tokens}"
                           f"{f' of --config {args.config}' if args.config else ''}: SP + AsyncTP would never run. "
                           f"Give a threshold of at most {base.max_num_tokens}, or --threshold never for SP and "
                           "AsyncTP off")
        config = Policy.gate(BASELINE, SP_ASYNC_TP, args.threshold).to_config(base)
    else:
        rec = rows.recommend(df, base)
        config = rec.config
    from sp_lab.serving.on_rows import serving_answer

    path = rows.export(df, config, args.out, recommendation=rec, chosen_in="python -m sp_lab export",
                       vllm_release=args.vllm_release, matmul_rows=matmul_rows(args.matmul_rows),
                       traffic=serving_answer(df, config=config))  # the file says what it does on chat traffic
    print(describe_file(path))
    return 0


def matmul_rows(path: Path | None) -> pl.DataFrame | None:
    """``--matmul-rows``: per-matmul fused / unfused rows, checked for the columns the model-level gates need."""
    import polars as pl

    if path is None:
        return None
    if not path.is_file() or path.suffix not in (".parquet", ".csv"):
        raise CliError(f"--matmul-rows {path}: expected a .parquet or .csv file of per-matmul rows "
                       "(sp_lab.tuning.microbench.measure_matmuls)")
    df = pl.read_parquet(path) if path.suffix == ".parquet" else pl.read_csv(path)
    need = ("name", "side", "k", "n", "dtype", "tp", "m", "fused_us", "unfused_us")
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise CliError(f"--matmul-rows {path}: lacks columns {missing} (measure_matmuls writes them)")
    return df
