"""What one shared Dynamo capture saves when a model is compiled several ways, as a sweep compiles its variants:
each variant of ``--variants`` compiled and called once at each of ``--tokens``, with a capture per variant
(``captures=None``) and with one ``sp_lab.SharedCaptures`` for all of them (what ``run_sweep`` does), cold, on 2 gloo
CPU ranks (a benchmark, not a timed test).

    python benchmarks/bench_shared_capture.py                                # the toy, 2 layers, 3 pairs
    python benchmarks/bench_shared_capture.py --model llama-3-8b --layers 2 --pairs 3 --out out/shared.json

How it keeps the comparison honest:

- **Each trial runs in new rank processes with empty caches** (a new ``TORCHINDUCTOR_CACHE_DIR`` and
  ``SP_LAB_CACHE_DIR`` per trial), so no trial loads what another compiled; Inductor's one-time start-up is paid
  on a throw-away function before the clock starts.
- **The two ways alternate** (separate, shared, then shared, separate, ...), the first of each pair rotating;
  the summary gives each pair's ratio shared / separate, their median, and each way's seconds.
- ``compile_s`` is the wall time of every variant's first calls at every token count (the ranges a sweep
  needs, each call with its forward), the slower rank's; ``capture_s`` is Dynamo's share of it, from the
  reports, and ``captures`` the number of Dynamo captures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from machine import machine

import sp_lab
from sp_lab.compiler import capture
from sp_lab.programs import REFERENCE_VARIANTS, variant_config

WAYS = ("separate", "shared")


def _trial(way: str, model_name: str, layers: int, tokens: list[int], variants: list[str]) -> dict:
    """In a fresh rank: every variant compiled and called at every token count, sharing captures or not."""
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.compile(lambda t: t * 2 + 1, fullgraph=True)(torch.ones(8))  # Inductor's start-up, off the clock
    model = sp_lab.models.build(model_name, tp_rank=rank, tp_size=tp, num_layers=layers)
    base = sp_lab.LabConfig(tp_size=tp, async_tp_min_tokens=tokens[1] if len(tokens) > 1 else tokens[0],
                            max_num_tokens=max(tokens))
    shared = sp_lab.SharedCaptures(model) if way == "shared" else None
    before = capture.counters["captures"]
    dist.barrier()
    started = time.perf_counter()
    reports = []
    for variant in variants:
        compiled = sp_lab.compile(model, variant_config(variant, base, tp_size=tp), captures=shared)
        with torch.no_grad():
            for n in tokens:
                compiled(torch.randint(0, model.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(n)))
        reports.append(compiled.report)
    compile_s = time.perf_counter() - started
    dist.barrier()
    return {"way": way, "rank": rank, "compile_s": compile_s, "captures": capture.counters["captures"] - before,
            "capture_s": sum(g.capture_time_s for r in reports for g in r.graphs),
            "ranges": sum(1 for r in reports for rng in r.ranges if rng.compiled)}


def _run_trial(way: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="sp_lab_bench_shared_") as cache:
        # The ranks inherit this environment: caches private to this trial, empty.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache) / "inductor")
        os.environ["SP_LAB_CACHE_DIR"] = str(Path(cache) / "sp_lab")
        ranks = sp_lab.launch(_trial, way, args.model, args.layers, list(args.tokens), list(args.variants),
                              world_size=2, timeout=3600.0)
    return max(ranks, key=lambda r: r["compile_s"])  # a TP step waits for its slower rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="toy", help="a zoo preset or 'toy'")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4, 16, 64],
                        help="the sweep's token counts, called in this order (default 4 16 64)")
    parser.add_argument("--variants", nargs="+", default=list(REFERENCE_VARIANTS), choices=REFERENCE_VARIANTS)
    parser.add_argument("--pairs", type=int, default=3, help="separate/shared pairs, the first of each rotating")
    parser.add_argument("--out", type=Path, help="also write the pairs and the summary to this JSON file")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    if len(args.variants) < 2:
        parser.error(f"--variants {args.variants}: sharing needs at least two variants of the model")

    pairs = []
    for i in range(args.pairs):
        order = WAYS if i % 2 == 0 else tuple(reversed(WAYS))
        trials = {way: _run_trial(way, args) for way in order}
        pairs.append({**trials, "shared_over_separate": trials["shared"]["compile_s"] / trials["separate"]["compile_s"]})
        print(json.dumps(pairs[-1]), flush=True)
    summary = {
        "median_shared_over_separate": statistics.median(p["shared_over_separate"] for p in pairs),
        **{f"{way}_compile_s": [round(p[way]["compile_s"], 2) for p in pairs] for way in WAYS},
        **{f"{way}_captures": pairs[0][way]["captures"] for way in WAYS},
    }
    meta = {"machine": machine(), "model": args.model, "layers": args.layers, "tokens": args.tokens,
            "variants": args.variants, "ranks": "2 gloo CPU ranks", "caches": "empty per trial", "kind": "measured"}
    print(json.dumps({"meta": meta, "summary": summary}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "summary": summary, "pairs": pairs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
