"""The reduce_scatter side's final reduction, as PyTorch's fused matmul + reduce_scatter runs it, on one GPU.

``torch.distributed._symmetric_memory._fused_matmul_reduce_scatter_impl`` (scatter_dim 0) gathers every
peer's ``[M / tp, N]`` partial into ``stacked_partials [M, N]`` and sums it as ``[tp, M / tp, N]`` over dim 0:
reads ``M * N``, writes ``M / tp * N``. On a one-rank group (what ``data/h200/matmul_single_gpu.json``'s
``fused_ws1`` rows time) the same call sums ``[1, M, N]``: reads and writes ``M * N``. This times both sums
(bf16, CUDA-graph replay of 20 calls, mean of 20 replays after 3 warm-ups) so the model can swap the one-rank
reduction in its measured own cost for the ``tp``-rank one. In the same run, on the same GPU: the plain matmul and
the one-rank fused op at the Llama-3-70B tp 8 o_proj shard shape (``[M, 1024] @ [1024, 8192]``), whose difference
is the one-rank own cost the sum is part of.

    python benchmarks/bench_rs_reduction.py --out data/h200/rs_reduction.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_matmul_h200 import init_one_rank_group  # one-rank NCCL group with symmetric memory enabled

SHAPES_N = (8192,)
"""N of the reduce_scatter-side matmuls of Llama-3-70B at tp 8 (o_proj and down_proj output the hidden size)."""
ROWS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
TPS = (1, 2, 4, 8, 16)


def graph_us(fn, calls: int = 20, replays: int = 20) -> float:
    """Mean microseconds per call of ``fn`` replayed in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000.0 * start.elapsed_time(end) / (replays * calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows, own = [], []
    for n in SHAPES_N:
        for m in ROWS:
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            for tp in TPS:
                view = x.view(tp, m // tp, n)
                us = graph_us(lambda v=view: torch.sum(v, dim=0))
                rows.append({"m": m, "n": n, "tp": tp, "us": round(us, 3)})
                print(rows[-1], flush=True)
            del x
    group, error = init_one_rank_group()
    if group is None:
        raise SystemExit(f"one-rank symmetric-memory group unavailable: {error}")
    n, k = 8192, 1024  # o_proj's shard at tp 8
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    for m in ROWS:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        mm = graph_us(lambda a=a: torch.mm(a, b))
        ws1 = graph_us(lambda a=a: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group))
        own.append({"m": m, "n": n, "k": k, "mm_us": round(mm, 3), "fused_ws1_us": round(ws1, 3)})
        print(own[-1], flush=True)
    dist.destroy_process_group()
    p = torch.cuda.get_device_properties(0)
    meta = {"device": f"{p.name} (1 GPU)", "torch": torch.__version__, "dtype": "bfloat16",
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "method": "torch.sum(x.view(tp, m // tp, n), dim=0) on a contiguous bf16 [m, n]; CUDA graph of 20 calls, "
                      "mean of 20 replays after 3 warm-ups; microseconds per call",
            "what": "rows: tp = 1 is the one-rank fused op's reduction, tp > 1 the tp-rank op's (torch "
                    "_fused_matmul_reduce_scatter_impl, scatter_dim 0); one_rank_fused: plain matmul and "
                    "torch.ops.symm_mem.fused_matmul_reduce_scatter on a one-rank NCCL group, same timing"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "one_rank_fused": own}, f, indent=1)


if __name__ == "__main__":
    main()
