"""Eager forward latency of sp_lab models, per token count (tp=1, one process, CPU by default).

    python benchmarks/bench_eager.py                                  # toy + 2-layer llama-3-8b, 16..1024 tokens
    python benchmarks/bench_eager.py --models toy --tokens 16 64 --repeats 20 --json

This is the eager baseline the compiled and sequence-parallel variants are measured against. Each
row is the median of ``--repeats`` timed forwards after ``--warmup`` untimed ones
(:func:`sp_lab.bench.timing.time_cpu`), under ``torch.inference_mode``. "2-layer llama-3-8b" keeps the
real shapes (hidden 4096, GQA 32/8, MLP 14336, vocab 128256) with only two decoder layers, so its
time is dominated by the LM head (4096 x 128256) at every token count.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from machine import describe, machine

from sp_lab import models
from sp_lab.bench.timing import time_cpu

DEFAULT_MODELS = {"toy": {}, "llama-3-8b": {"num_layers": 2}}
"""Model name -> build() overrides (any other preset gets ``num_layers=2``)."""
DEFAULT_REPEATS = {"toy": (5, 30)}
"""Model name -> (warmup, repeats) when not given; the toy is cheap, so more samples beat the noise."""
LARGE_MODEL_REPEATS = (1, 3)
"""(warmup, repeats) for presets: a 2-layer llama-3-8b forward takes seconds on a small CPU."""


def bench_model(
    name: str, build_kw: dict, tokens: list[int], *, dtype: torch.dtype, warmup: int, repeats: int
) -> list[dict]:
    """One row per token count: median / p10 / p90 forward time in ms and tokens per second."""
    started = time.perf_counter()
    model = models.build(name, dtype=dtype, **build_kw)
    build_s = time.perf_counter() - started
    rows = []
    for num_tokens in tokens:
        ids = torch.randint(
            0, model.spec.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0)
        )
        with torch.inference_mode():
            timing = time_cpu(lambda: model(ids), warmup=warmup, repeats=repeats, barrier=False)  # noqa: B023
        rows.append(
            {
                "model": name
                if not build_kw
                else f"{name} ({', '.join(f'{k}={v}' for k, v in build_kw.items())})",
                "dtype": str(dtype).removeprefix("torch."),
                "num_tokens": num_tokens,
                "median_ms": timing.median_us / 1e3,
                "p10_ms": timing.p10_us / 1e3,
                "p90_ms": timing.p90_us / 1e3,
                "tokens_per_s": num_tokens / (timing.median_us / 1e6),
                "repeats": timing.repeats,
                "build_s": build_s,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="toy and/or preset names")
    parser.add_argument("--tokens", nargs="+", type=int, default=[16, 64, 256, 1024])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--warmup", type=int, default=None, help="untimed forwards (default per model)")
    parser.add_argument("--repeats", type=int, default=None, help="timed forwards (default per model)")
    parser.add_argument("--json", action="store_true", help="print rows as JSON lines instead of a table")
    args = parser.parse_args(argv)

    dtype = getattr(torch, args.dtype)
    info = machine()
    rows = []
    for name in args.models:
        warmup, repeats = DEFAULT_REPEATS.get(name, LARGE_MODEL_REPEATS)
        rows += bench_model(
            name,
            DEFAULT_MODELS.get(name, {"num_layers": 2}),
            args.tokens,
            dtype=dtype,
            warmup=warmup if args.warmup is None else args.warmup,
            repeats=repeats if args.repeats is None else args.repeats,
        )
    if args.json:
        for row in rows:
            print(json.dumps({**row, **info}))
        return
    print(describe(info))
    header = (
        f"{'model':<34} {'dtype':<9} {'tokens':>6} {'median ms':>10} {'p10 ms':>9} {'p90 ms':>9} {'tok/s':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['model']:<34} {r['dtype']:<9} {r['num_tokens']:>6} {r['median_ms']:>10.2f} "
            f"{r['p10_ms']:>9.2f} {r['p90_ms']:>9.2f} {r['tokens_per_s']:>9.0f}"
        )
    for model in dict.fromkeys(r["model"] for r in rows):
        print(f"build {model}: {next(r['build_s'] for r in rows if r['model'] == model):.1f} s")


if __name__ == "__main__":
    main()
