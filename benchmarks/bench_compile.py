"""Compile time of sp_lab's piecewise pipeline vs plain ``torch.compile(fullgraph=True)``, cold, on 2 gloo CPU
ranks (a benchmark, not a timed test), plus the latency of the ``gather`` and ``sharded`` boundary strategies.

Model: ``--model`` (default ``llama-3-8b``) with ``--layers`` layers (the real widths: hidden 4096, MLP 14336, vocab 128256), bf16
by default to halve the weights. Target: every range a sweep needs in at most 1.0x plain Inductor's time.

    python benchmarks/bench_compile.py                          # 2 layers, tokens 4 16 64 256, 3 repeats
    python benchmarks/bench_compile.py --layers 4 --repeats 5 --out out/bench_compile.json
    python benchmarks/bench_compile.py --warm                   # also: sp_lab again on the caches it filled
    python benchmarks/bench_compile.py --one "sp_lab sharded"   # one cold trial (time it from outside)

How it keeps the comparison honest:

- **Each trial runs in new rank processes with empty caches** (a new ``TORCHINDUCTOR_CACHE_DIR`` and
  ``SP_LAB_CACHE_DIR`` per trial). On CPU, ``sp_lab.launch`` forks the ranks from a fork server that has only
  imported torch, Dynamo and Inductor (unless ``SP_LAB_FORKSERVER=0``); a server serves one environment, so each
  trial's new cache directories start a new server (a ``--warm`` trial, on its cold trial's directories, forks
  from that trial's server). With a CUDA device the ranks are fresh interpreters. Either way nobody inherits
  compiled kernels, FX graphs, sp_lab's range artifacts or Dynamo state from a previous contender. ``--warm``
  adds, after each cold sp_lab trial, a trial on the caches it filled (a second run, a kernel restart).
  Inductor's one-time start-up is paid in every trial on a throw-away function before the clock starts, and
  reported apart (``startup_s``).
- **The order alternates**: repeat *r* runs the contenders rotated by *r*, so no contender is always first
  (a loaded or warming machine then slows every contender alike).
- **Every range a sweep compiles counts**: the model is called once at each of ``--tokens`` in order, as a
  sweep does; ``compile_s`` is the sum of those first calls (each includes one forward). With the default
  ``async_tp_min_tokens`` (the second smallest token count) sp_lab compiles two ranges (without and with
  SP/AsyncTP) where ``torch.compile`` compiles one dynamic graph; ``first_range_s`` is the first call alone.
  ``graphs`` is Dynamo's count of unique graphs, ``ranges`` sp_lab's compiled ranges.
- ``--repeats`` (at least 3) trials per contender; the summary gives median, min and max, and the ratios of
  medians against ``torch.compile``.

Prints one JSON line per trial, then a summary line; ``--out`` also writes everything to a JSON file.
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

CONTENDERS = ("torch.compile", "sp_lab gather", "sp_lab sharded")
BASELINE = "torch.compile"
TARGET_RATIO = 1.0  # sp_lab's compile of every range a sweep needs, over torch.compile's


def _ids(n: int, vocab: int, device: str = "cpu") -> torch.Tensor:
    x = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).to(device)
    torch._dynamo.mark_dynamic(x, 0)  # as a serving engine marks its token dimension
    return x


def _timed(fn, x) -> float:
    """Wall time of one call on this rank, started and ended together with the peer."""
    dist.barrier()
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(x)
    if x.is_cuda:
        torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - t0


def _latency_ms(fn, x, repeats: int) -> float:
    with torch.no_grad():
        for _ in range(2):
            fn(x)
        runs = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn(x)
            if x.is_cuda:
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(runs)


def _trial(contender: str, model_name: str, layers: int, tokens: list[int], dtype: str, latency_repeats: int,
           device: str = "cpu") -> dict:
    """One contender in this fresh rank: start-up, the sweep's first calls, then (sp_lab) latency."""
    from torch._dynamo.utils import counters

    rank, tp = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    # Inductor's one-time start-up is paid by whatever compiles first in a process: pay it on a throw-away
    # function so that compile_s measures the model, in every trial alike.
    torch.compile(lambda t: t * 2 + 1, fullgraph=True)(torch.ones(8, device=device))
    startup_s = time.perf_counter() - t0
    model = sp_lab.models.build(model_name, tp_rank=rank, tp_size=tp, num_layers=layers,
                                dtype=getattr(torch, dtype), device=device)
    vocab = model.spec.vocab_size
    torch._dynamo.reset()
    counters.clear()
    if contender == BASELINE:
        compiled = torch.compile(model, fullgraph=True)
    else:
        threshold = tokens[1] if len(tokens) > 1 else tokens[0]
        config = sp_lab.LabConfig(tp_size=tp, async_tp_min_tokens=threshold, max_num_tokens=max(tokens),
                                  boundary=contender.split()[-1])
        compiled = sp_lab.compile(model, config)
    first_calls = {n: _timed(compiled, _ids(n, vocab, device)) for n in tokens}
    result = {
        "contender": contender, "rank": rank, "startup_s": startup_s,
        "compile_s": sum(first_calls.values()), "first_range_s": first_calls[tokens[0]],
        "first_call_s": first_calls, "graphs": int(counters["stats"]["unique_graphs"]),
    }
    if contender != BASELINE:
        result["ranges"] = sum(1 for r in compiled.report.ranges if r.compiled)
        result["artifact_cache"] = [r.artifact_cache for r in compiled.report.ranges if r.compiled]
        result["latency_ms"] = {n: _latency_ms(compiled, _ids(n, vocab, device), latency_repeats) for n in tokens}
    return result


def trial_order(contenders: tuple[str, ...], repeats: int) -> list[tuple[int, str]]:
    """``(repeat, contender)`` in run order: repeat r is the contenders rotated by r."""
    k = len(contenders)
    return [(r, contenders[(r + i) % k]) for r in range(repeats) for i in range(k)]


def _summary(trials: list[dict]) -> dict:
    out: dict = {}
    for contender in CONTENDERS:
        mine = [t for t in trials if t["contender"] == contender]
        if not mine:
            continue
        out[contender] = {
            key: {"median": statistics.median(t[key] for t in mine), "min": min(t[key] for t in mine),
                  "max": max(t[key] for t in mine)}
            for key in ("compile_s", "first_range_s", "startup_s")
        } | {"graphs": sorted({t["graphs"] for t in mine}), "ranges": sorted({t.get("ranges", 0) for t in mine}),
             "trials": len(mine)}
    base = out.get(BASELINE)
    for contender, stats in out.items():
        if base and contender != BASELINE:
            for key in ("compile_s", "first_range_s"):
                stats[f"{key}_vs_torch_compile"] = stats[key]["median"] / base[key]["median"]
    return out


def _run_trial(contender: str, args: argparse.Namespace, cache: str, repeat: int, warm: bool = False) -> dict:
    # The ranks inherit this environment: caches private to this trial (empty unless warm).
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache) / "inductor")
    os.environ["SP_LAB_CACHE_DIR"] = str(Path(cache) / "sp_lab")
    ranks = sp_lab.launch(_trial, contender, args.model, args.layers, list(args.tokens), args.dtype,
                          args.latency_repeats, args.device, world_size=args.tp, timeout=3600.0,
                          backend="nccl" if args.device == "cuda" and args.tp > 1 else "gloo")
    # A TP step is as slow as its slowest rank: keep the rank with the longer compile.
    trial = max(ranks, key=lambda r: r["compile_s"]) | {"repeat": repeat, "caches": "warm" if warm else "cold"}
    print(json.dumps(trial), flush=True)
    return trial


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3-8b", help="a preset or 'toy' (for a quick check)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4, 16, 64, 256],
                        help="the sweep's token counts, called in this order (default 4 16 64 256)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tp", type=int, default=2, help="ranks (default 2 gloo CPU ranks)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: one GPU per rank (the H200 figures: --device cuda --tp 1)")
    parser.add_argument("--repeats", type=int, default=3, help="trials per contender (at least 3)")
    parser.add_argument("--latency-repeats", type=int, default=5)
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--out", type=Path, help="also write trials and summary to this JSON file")
    parser.add_argument("--warm", action="store_true",
                        help="after each cold sp_lab trial, one more on the caches it filled")
    parser.add_argument("--one", choices=CONTENDERS,
                        help="only one cold trial of this contender, printed as one JSON line")
    args = parser.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory(prefix="sp_lab_bench_cache_") as cache:
            _run_trial(args.one, args, cache, repeat=0)
        return 0
    if args.repeats < 3:
        parser.error(f"--repeats {args.repeats}: at least 3 trials per contender, so one outlier shows")

    trials, warm = [], []
    for repeat, contender in trial_order(tuple(args.contenders), args.repeats):
        with tempfile.TemporaryDirectory(prefix="sp_lab_bench_cache_") as cache:
            trials.append(_run_trial(contender, args, cache, repeat))
            if args.warm and contender != BASELINE:
                warm.append(_run_trial(contender, args, cache, repeat, warm=True))

    meta = {"machine": machine(), "model": args.model, "layers": args.layers, "tokens": args.tokens, "dtype": args.dtype,
            "repeats": args.repeats, "ranks": args.tp, "device": args.device, "cache": "empty per trial",
            "target_ratio": TARGET_RATIO}
    summary = _summary(trials)
    if warm:
        summary["warm"] = {c: v for c, v in _summary(warm).items() if c != BASELINE}
        for contender, stats in summary["warm"].items():
            base = summary.get(BASELINE)
            if base:
                stats["compile_s_vs_torch_compile"] = stats["compile_s"]["median"] / base["compile_s"]["median"]
    print(json.dumps({"meta": meta, "summary": summary}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "summary": summary, "trials": trials + warm}, indent=1))
    ratios = [summary.get(c, {}).get("compile_s_vs_torch_compile") for c in CONTENDERS if c != BASELINE]
    return 0 if all(r is None or r <= TARGET_RATIO for r in ratios) else 1


if __name__ == "__main__":
    raise SystemExit(main())
