"""``sweep``: measure latency rows into a store (resumes; spawns --tp ranks, or runs in place under torchrun)."""

from __future__ import annotations

import argparse
from pathlib import Path

from sp_lab.cli.arguments import STORE_HELP, add_measure_args, variant_list
from sp_lab.cli.ranks import is_rank0, sweep
from sp_lab.cli.rows import base_config
from sp_lab.programs import REFERENCE_VARIANTS

HELP = "measure latency rows into a store (resumes where it stopped)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_measure_args(p)
    p.add_argument("--variants", type=variant_list, default=list(REFERENCE_VARIANTS),
                   help="comma-separated: baseline, sp, sp+async_tp, tuned (default the first three)")
    p.add_argument("--store", type=Path, default=None, help=STORE_HELP)
    p.add_argument("--reports-dir", type=Path, default=None, help="save each variant's CompileReport JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    result = sweep(args, store=args.store, variants=args.variants, config=base_config(args),
                   reports_dir=args.reports_dir, progress=not args.no_progress)
    if is_rank0():
        print(f"sweep: {len(result.rows)} row(s) measured, {result.skipped} already in the store -> {args.store}")
        if result.fusion_missing:
            print(f"warning: {len(result.fusion_missing)} row(s) flagged fusion_missing "
                  "(the variant's SP rewrite or fusion did not run)")
    return 0
