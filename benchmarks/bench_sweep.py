"""Benchmark: a latency sweep end to end, as a user runs it from a notebook or the CLI.

Measures, for ``--tokens`` x ``--variants`` on ``--tp`` ranks (default: the toy model, 10 token counts,
3 variants, 2 gloo CPU ranks):

- wall time of the whole sweep (rank start-up, Inductor start-up, compiles, measurements);
- time to the first row on disk (the first part file's modification time) and to the first ``on_row``
  callback in the calling process (the moment a live plot can draw its first point);
- the spread between consecutive rows (compile-dominated points stand out).

Run::

    python benchmarks/bench_sweep.py                      # toy, tp=2, 10 token counts, 3 variants
    python benchmarks/bench_sweep.py --tokens 1,64 --json out/bench_sweep.json
    python benchmarks/bench_sweep.py --cache-dir /tmp/c  # twice: the first point cold, then warm

Each run writes to a fresh store (a temporary directory unless ``--store``), so nothing is resumed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import machine

from sp_lab.bench.store import SweepStore
from sp_lab.bench.sweep import DEFAULT_VARIANTS, launch_sweep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="toy")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--store", type=Path, default=None, help="default: a fresh temporary directory")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="Inductor's and sp_lab's caches under this directory (inductor/, sp_lab/): empty for a "
                             "cold start, run again for a warm one (default: whatever the environment says)")
    args = parser.parse_args()
    if args.cache_dir is not None:
        # The ranks inherit this environment.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(args.cache_dir / "inductor")
        os.environ["SP_LAB_CACHE_DIR"] = str(args.cache_dir / "sp_lab")

    from sp_lab.config import LabConfig

    tokens = [int(t) for t in args.tokens.split(",")]
    variants = args.variants.split(",")
    store_dir = args.store or Path(tempfile.mkdtemp(prefix="bench_sweep_"))
    arrivals: list[float] = []
    start = time.perf_counter()
    wall_start = time.time()
    result = launch_sweep(
        args.model,
        world_size=args.tp,
        store_dir=store_dir,
        token_counts=tokens,
        variants=variants,
        config=LabConfig(tp_size=args.tp),
        warmup=args.warmup,
        repeats=args.repeats,
        on_row=lambda row: arrivals.append(time.perf_counter() - start),
        progress=False,
    )
    wall_s = time.perf_counter() - start

    parts = SweepStore(store_dir).parts()
    on_disk = sorted(p.stat().st_mtime - wall_start for p in parts)
    df = SweepStore(store_dir).read()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    figures = {
        "machine": machine(),
        "command": " ".join(sys.argv),
        "model": args.model,
        "tp": args.tp,
        "points": len(tokens) * len(variants),
        "rows_written": len(result.rows),
        "wall_s": round(wall_s, 2),
        "first_row_on_disk_s": round(on_disk[0], 2) if on_disk else None,
        "first_on_row_callback_s": round(arrivals[0], 2) if arrivals else None,
        "caches": str(args.cache_dir) if args.cache_dir is not None else "from the environment",
        "median_gap_between_rows_s": round(statistics.median(gaps), 2) if gaps else None,
        "max_gap_between_rows_s": round(max(gaps), 2) if gaps else None,
        "fusion_missing_rows": int(df["fusion_missing"].sum()),
        "store": str(store_dir),
    }
    print(json.dumps(figures, indent=2))
    import polars as pl

    with pl.Config(tbl_rows=-1, tbl_hide_dataframe_shape=True):
        cols = (
            "reported_variant",
            "num_tokens",
            "latency_us",
            "sp_rewrites",
            "n_fused_ag_mm",
            "n_fused_mm_rs",
        )
        print(df.select(cols).sort("reported_variant", "num_tokens"))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
