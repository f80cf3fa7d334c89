"""CPU dry run of the multi-GPU run: ``run.sh`` itself, with ``PROFILE=cpu``.

The same plan (the 2-GPU machine's, by default only llama-2-7b's two boundary strategies), the same
``torchrun ... -m sp_lab run`` command lines and the same collection, but with the toy model on gloo ranks
and three token counts, then ``compare.py`` on what came back. It checks the output against what a remote GPU
runner sends back (at most 8 files directly in ``$OUT``, each under 15 MiB and plainly named), and that there is
one parquet with every variant of every job and a summary whose jobs all finished. Takes ~2-4 minutes on two cores.

    python benchmarks/multigpu/dry_run.py               # llama-2-7b's jobs (toy-sized), both boundaries
    python benchmarks/multigpu/dry_run.py --all          # all four jobs of the 2-GPU plan
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_FILES, MAX_BYTES = 8, 15 * 2**20


def check_out(out: Path) -> list[str]:
    """Problems with ``out`` as a remote runner would return it (empty list: none)."""
    import polars as pl

    problems = []
    entries = sorted(out.iterdir())
    if len(entries) > MAX_FILES:
        problems.append(f"{len(entries)} entries in $OUT; at most {MAX_FILES} files come back")
    for path in entries:
        if not path.is_file():
            problems.append(f"{path.name} is not a plain file")
        elif path.stat().st_size > MAX_BYTES:
            problems.append(f"{path.name} is {path.stat().st_size / 2**20:.1f} MiB (> 15 MiB)")
        if not re.fullmatch(r"[A-Za-z0-9._-]+", path.name):
            problems.append(f"{path.name!r} has characters a remote runner may refuse")
    summary = json.loads((out / "summary.json").read_text())
    for job in summary["jobs"]:
        if job["status"] != "ok":
            problems.append(f"job {job['id']}: {job['status']} {job['reason']}")
    rows = pl.read_parquet(out / "multigpu_rows.parquet")
    for job in summary["jobs"]:
        mine = rows.filter((pl.col("boundary") == job["boundary"]) & (pl.col("tp") == job["tp"]))
        missing = {"baseline", "sp", "sp+async_tp", "tuned"} - set(mine["variant"])
        if missing:
            problems.append(f"job {job['id']}: no rows for {sorted(missing)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="every job of the 2-GPU plan (twice as long)")
    parser.add_argument("--keep", type=Path, default=None, help="write $OUT here instead of a temporary folder")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sp_lab_dry_") as tmp:
        out = args.keep or Path(tmp) / "out"
        env = {**os.environ, "PROFILE": "cpu", "GPUS": "2", "OUT": str(out), "WORK": str(Path(tmp) / "work"),
               "BUDGET_S": "900"}
        if not args.all:
            env["ONLY"] = "llama-2-7b"
        start = time.monotonic()
        run = subprocess.run(["bash", str(REPO / "benchmarks" / "multigpu" / "run.sh")], env=env, check=False)
        print(f"dry run: run.sh exited {run.returncode} after {time.monotonic() - start:.0f} s")
        print("$OUT:", ", ".join(f"{p.name} ({p.stat().st_size / 1024:.0f} KiB)" for p in sorted(out.iterdir())))
        problems = check_out(out)
        cmp = subprocess.run([sys.executable, str(REPO / "benchmarks" / "multigpu" / "compare.py"),
                              str(out / "multigpu_rows.parquet"), "--out", str(Path(tmp) / "compare")],
                             capture_output=True, text=True, check=False)
        if cmp.returncode:
            problems.append(f"compare.py failed:\n{cmp.stderr[-2000:]}")
        else:
            print(cmp.stdout.split("## Prediction error per point")[0])
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print("dry run OK" if not problems and run.returncode == 0 else "dry run FAILED")
    return 0 if not problems and run.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
