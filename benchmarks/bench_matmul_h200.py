"""Single-GPU matmul table for the performance model (sp_lab.tuning.predict.kernels).

On one GPU, for the TP shard shapes of Llama-3-70B (TP=8/4/2) and Llama-3-8B (TP=4/2) and
M in {1, 2, 4, ..., 16384} total tokens, times (bf16, CUDA-graph replay, median per call):

- ``mm``          one ``[M, K] @ [K, N]`` matmul (M padded up to a multiple of tp);
- ``mm_chunked``  the same rows split into ``tp`` chunks, one matmul each: the chunking penalty a
                  ``tp``-way fused kernel pays (docs/measured-h200.md);
- ``fused_ws1``   the symmetric-memory fused op (``fused_all_gather_matmul`` on the AG side,
                  ``fused_matmul_reduce_scatter`` on the RS side) on a 1-rank NCCL group: the fused
                  kernel's own overhead with no communication (it splits into world_size=1 chunk).

Writes ``matmul_single_gpu.json`` (meta with provenance + rows) and ``matmul_single_gpu.parquet``
to ``$OUT`` (default ``./out``). Every measurement sits in its own try/except: a failure is
recorded in the row's ``error`` column and the run goes on. Takes ~1-3 minutes on an H200.

    python benchmarks/bench_matmul_h200.py                # on the GPU machine
    python benchmarks/bench_matmul_h200.py --cpu-smoke    # tiny shapes on CPU, checks the plumbing

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1): it is set below
before torch is imported, because a program using it can take a shared host's GPUs out of service.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse
import json
import socket
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from sp_lab.bench.timing import time_cpu, time_cuda
from sp_lab.tuning.microbench import (
    MEASURED,
    MatmulShape,
    padded_tokens,
    provenance,
    symm_mem_fused_impl,
    tflops,
    tp_matmul_shapes,
)

# Public HF configs (meta-llama/Meta-Llama-3-70B and -8B, config.json).
MODELS = {
    "llama-3-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "head_dim": 128},
    "llama-3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128},
}
CONFIGS = [("llama-3-70b", 8), ("llama-3-70b", 4), ("llama-3-70b", 2), ("llama-3-8b", 4), ("llama-3-8b", 2)]
TOKENS = [2**i for i in range(15)]  # 1 .. 16384

# Tiny stand-in for --cpu-smoke: same code paths, shapes a 2-core CPU does in seconds.
SMOKE_MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
               "head_dim": 32}


def _graph_replay_us(fn, *, calls: int, replays: int) -> float:
    """Microseconds per call from CUDA-graph replays; a failed capture is an error of the row, never an eager
    timing passed off as a kernel time."""
    timing = time_cuda(fn, warmup=2, repeats=replays, calls=calls, barrier=False)
    if timing.method != "cuda_graph":
        raise RuntimeError(timing.note or f"timed with {timing.method}, not CUDA-graph replays")
    return timing.median_us


def init_one_rank_group() -> tuple[str | None, str | None]:
    """A world_size-1 NCCL group on 127.0.0.1 with symmetric memory enabled -> (group_name, error)."""
    try:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        with socket.socket() as s:  # a free port on loopback only
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        group_name = dist.group.WORLD.group_name
        # Deprecated on torch 2.11-2.14 yet still required, or the fused ops refuse (pytorch #193027).
        symm_mem.enable_symm_mem_for_group(group_name)
        return group_name, None
    except Exception as exc:  # noqa: BLE001  (reported in every fused row instead)
        return None, f"{type(exc).__name__}: {exc}"[:500]


def measure_shape(shape: MatmulShape, tp: int, tokens: list[int], *, device: torch.device, dtype: torch.dtype,
                  group_name: str | None, group_error: str | None, timer, deadline: float) -> list[dict]:
    """All variants of one shape at every M; allocation is shared across M to keep the run short."""
    rows = []
    m_max = padded_tokens(max(tokens), tp)
    try:
        b = torch.randn(shape.k, shape.n, device=device, dtype=dtype)
        a_max = torch.randn(m_max, shape.k, device=device, dtype=dtype)
        out_max = torch.empty(m_max, shape.n, device=device, dtype=dtype)
    except Exception as exc:  # noqa: BLE001  (e.g. out of memory: recorded per row)
        err = f"allocation: {type(exc).__name__}: {exc}"[:500]
        return [{"name": shape.name, "side": shape.side, "n": shape.n, "k": shape.k, "tp": tp, "m": m,
                 "variant": v, "us": None, "error": err} for m in tokens for v in ("mm", "mm_chunked", "fused_ws1")]
    fused = symm_mem_fused_impl(group_name) if group_name else None
    for m in tokens:
        m_pad = padded_tokens(m, tp)
        a, out = a_max[:m_pad], out_max[:m_pad]
        rows_per_chunk = m_pad // tp
        variants = {
            "mm": (1, lambda a=a, out=out: torch.mm(a, b, out=out)),
            "mm_chunked": (tp, lambda a=a, out=out, r=rows_per_chunk: [
                torch.mm(a[i * r:(i + 1) * r], b, out=out[i * r:(i + 1) * r]) for i in range(tp)]),
            "fused_ws1": (1, (lambda a=a: fused(a, b, shape)) if fused else None),
        }
        for variant, (chunks, fn) in variants.items():
            row = {"name": shape.name, "side": shape.side, "n": shape.n, "k": shape.k, "tp": tp, "m": m,
                   "m_padded": m_pad, "variant": variant, "chunks": chunks, "world_size": 1, "us": None,
                   "tflops": None, "error": None}
            if fn is None:
                row["error"] = f"symmetric memory unavailable: {group_error}"
            elif time.monotonic() > deadline:
                row["error"] = "skipped: --budget-s exhausted"
            else:
                try:
                    row["us"] = round(timer(fn), 3)
                    row["tflops"] = round(tflops(m_pad, shape.n, shape.k, row["us"]), 2)
                except Exception as exc:  # noqa: BLE001  (one failure must not end the run)
                    row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                    if device.type == "cuda":
                        torch.cuda.synchronize()
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder (default $OUT or ./out)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU to check the script")
    parser.add_argument("--max-tokens", type=int, default=max(TOKENS), help="largest M (powers of two up to it)")
    parser.add_argument("--calls", type=int, default=10, help="matmuls captured per CUDA graph")
    parser.add_argument("--replays", type=int, default=5, help="timed graph replays (the median is kept)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="stop measuring after this many seconds")
    parser.add_argument("--no-fused", action="store_true", help="skip the symm_mem fused ops")
    args = parser.parse_args(argv)

    start = time.monotonic()
    deadline = start + args.budget_s
    if args.cpu_smoke:
        device, dtype = torch.device("cpu"), torch.float32
        configs, models = [("smoke", 4), ("smoke", 2)], {"smoke": SMOKE_MODEL}
        tokens = [t for t in TOKENS if t <= min(args.max_tokens, 64)]
        timer = lambda fn: time_cpu(fn, warmup=1, repeats=3, calls=2, barrier=False).median_us
        group_name, group_error = None, "not attempted (--cpu-smoke: no CUDA)"
    else:
        if not torch.cuda.is_available():
            print("bench_matmul_h200: no CUDA device. This benchmark times GPU kernels with CUDA graphs; "
                  "run it on the GPU machine, or pass --cpu-smoke to check the script on CPU.", file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda", 0), torch.bfloat16
        configs, models = CONFIGS, MODELS
        tokens = [t for t in TOKENS if t <= args.max_tokens]
        timer = partial(_graph_replay_us, calls=args.calls, replays=args.replays)
        group_name, group_error = (None, "skipped (--no-fused)") if args.no_fused else init_one_rank_group()
        torch.backends.cuda.matmul.allow_tf32 = False

    meta = {
        **provenance(device),
        "dtype": str(dtype).removeprefix("torch."),
        "source": MEASURED,
        "script": "benchmarks/bench_matmul_h200.py",
        "argv": sys.argv[1:] if argv is None else argv,
        "method": (f"median of {args.replays} CUDA-graph replays of {args.calls} calls each after warm-up; "
                   "us = microseconds per call; M padded up to a multiple of tp; mm_chunked = tp matmuls of "
                   "M/tp rows; fused_ws1 = symm_mem fused op on a 1-rank NCCL group (no communication)"
                   if device.type == "cuda" else "wall clock, CPU smoke test: plumbing only, not a measurement"),
        "models": {name: models[name] for name in dict.fromkeys(n for n, _ in configs)},
        "symm_mem_group": group_name,
        "symm_mem_error": group_error,
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
    }
    print(f"device={meta['device']} torch={meta['torch']} cuda={meta['cuda']} symm_mem={group_name or group_error}")

    rows = []
    for model, tp in configs:
        for shape in tp_matmul_shapes(models[model], tp):
            t0 = time.monotonic()
            shape_rows = measure_shape(shape, tp, tokens, device=device, dtype=dtype, group_name=group_name,
                                       group_error=group_error, timer=timer, deadline=deadline)
            rows += [{"model": model, **r} for r in shape_rows]
            errors = sum(r["error"] is not None for r in shape_rows)
            print(f"{model} tp={tp} {shape.name:8s} K={shape.k:6d} N={shape.n:6d}: {len(shape_rows)} rows, "
                  f"{errors} errors, {time.monotonic() - t0:.1f}s", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    meta["wall_s"] = round(time.monotonic() - start, 1)
    meta["columns"] = {
        "model/tp/name/side": "Llama preset, tensor-parallel size, matmul (qkv/o_proj AG-side/RS-side ...)",
        "m": "total tokens of the step", "m_padded": "m padded to a multiple of tp (rows actually multiplied)",
        "n, k": "local weight shard [K, N]", "variant": "mm | mm_chunked | fused_ws1",
        "chunks": "matmuls the rows are split into", "us": "microseconds per call (null on error)",
        "tflops": "achieved TFLOP/s on m_padded rows", "error": "exception text when the measurement failed",
    }

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "matmul_single_gpu.json"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    written = [json_path]
    try:  # pyarrow is on the GPU image; polars may not be
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist([{**r, "source": MEASURED, "device": meta["device"], "torch": meta["torch"],
                                       "cuda": meta["cuda"], "date": meta["date"], "dtype": meta["dtype"]}
                                      for r in rows])
        table = table.replace_schema_metadata({"sp_lab.meta": json.dumps(meta)})
        pq.write_table(table, out / "matmul_single_gpu.parquet")
        written.append(out / "matmul_single_gpu.parquet")
    except Exception as exc:  # noqa: BLE001  (the JSON is the primary output)
        print(f"parquet not written ({type(exc).__name__}: {exc}); the JSON holds the same rows", file=sys.stderr)

    n_err = sum(r["error"] is not None for r in rows)
    print(f"{len(rows)} rows ({n_err} with errors) in {meta['wall_s']} s -> {', '.join(map(str, written))}")
    if n_err:
        first = next(r for r in rows if r["error"])
        print(f"first error: {first['model']} tp={first['tp']} {first['name']} M={first['m']} "
              f"{first['variant']}: {first['error']}")
    if group_name:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
