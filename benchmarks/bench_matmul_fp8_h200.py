"""FP8 beside bf16 on one GPU: scaled matmuls at tensor-parallel shard shapes, and FP8 rehearsal rows.

1. Matmul table (``matmul_fp8_single_gpu.json``): for the shard shapes of Llama-3-70B at tp 8 and Llama-3-8B at
   tp 4 (``sp_lab.tuning.microbench.tp_matmul_shapes``) and M = 1, 2, 4, ..., 16384 total tokens, CUDA-graph
   replay times (median per call) of

   - ``bf16``                   ``torch.mm`` in bf16 (the reference every ratio divides by);
   - ``fp8_rowwise``            ``torch._scaled_mm``, float8_e4m3fn operands, per-token ``[M, 1]`` and per-channel
                                ``[1, N]`` float32 scales, bf16 out (vLLM's FP8 on Hopper);
   - ``fp8_tensorwise``         the same with scalar scales;
   - ``bf16_chunked`` / ``fp8_rowwise_chunked``  the rows split into ``tp`` matmuls (what a tp-way fused
                                collective kernel runs per chunk).

   The activation quantisation itself is not in these times (Inductor fuses it into the producer's kernel).
2. Rehearsal rows (``rehearsal_fp8.json``): ``sp_lab.bench.rehearsal.rehearse_numerics`` for a 2-layer
   Llama-3-8B built with ``quant="fp8"`` (rowwise, every boundary) and ``"fp8-tensorwise"`` (``sharded``) at tp 2
   and 4, all ranks on this one GPU with PyTorch's fused symmetric-memory scaled kernels; each row also says which
   fused op names the compiled graphs hold.

    python benchmarks/bench_matmul_fp8_h200.py [--skip-rehearsal] [--cpu-smoke]

Multicast stays off (set before torch is imported), as in bench_matmul_h200.py.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_matmul_h200 import MODELS, SMOKE_MODEL, TOKENS, _graph_replay_us

from sp_lab.bench.timing import time_cpu
from sp_lab.tuning.microbench import MEASURED, padded_tokens, provenance, tflops, tp_matmul_shapes

CONFIGS = [("llama-3-70b", 8), ("llama-3-8b", 4)]
VARIANTS = ("bf16", "fp8_rowwise", "fp8_tensorwise", "bf16_chunked", "fp8_rowwise_chunked")
FP8 = torch.float8_e4m3fn


def _variants(shape, tp: int, m_pad: int, device: torch.device) -> dict:
    """name -> zero-argument callable for one (shape, M)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m_pad, shape.k, device=device, generator=g, dtype=torch.bfloat16)
    b = torch.randn(shape.n, shape.k, device=device, generator=g, dtype=torch.bfloat16).t()  # column-major [K, N]
    a8, b8 = a.to(FP8), b.to(FP8)
    sa, sb = torch.rand(m_pad, 1, device=device) + 0.5, torch.rand(1, shape.n, device=device) + 0.5
    one = torch.tensor(1.0, device=device)
    out = torch.empty(m_pad, shape.n, device=device, dtype=torch.bfloat16)
    r = m_pad // tp

    def scaled(rows, scale_a, scale_b, o):
        return torch._scaled_mm(rows, b8, scale_a, scale_b, out_dtype=torch.bfloat16, out=o)

    return {
        "bf16": lambda: torch.mm(a, b, out=out),
        "fp8_rowwise": lambda: scaled(a8, sa, sb, out),
        "fp8_tensorwise": lambda: scaled(a8, one, one, out),
        "bf16_chunked": lambda: [torch.mm(a[i * r:(i + 1) * r], b, out=out[i * r:(i + 1) * r]) for i in range(tp)],
        "fp8_rowwise_chunked": lambda: [scaled(a8[i * r:(i + 1) * r], sa[i * r:(i + 1) * r], sb, out[i * r:(i + 1) * r])
                                        for i in range(tp)],
    }


def matmul_table(device: torch.device, configs, models, tokens, timer, deadline: float) -> list[dict]:
    rows = []
    for model, tp in configs:
        for shape in tp_matmul_shapes(models[model], tp):
            t0 = time.monotonic()
            for m in tokens:
                m_pad = padded_tokens(m, tp)
                try:
                    fns = _variants(shape, tp, m_pad, device)
                except Exception as exc:  # noqa: BLE001  (recorded per row)
                    fns, err = {}, f"{type(exc).__name__}: {exc}"[:400]
                for variant in VARIANTS:
                    row = {"model": model, "tp": tp, "name": shape.name, "side": shape.side, "n": shape.n, "k": shape.k,
                           "m": m, "m_padded": m_pad, "variant": variant,
                           "dtype": "bfloat16" if variant.startswith("bf16") else "float8_e4m3fn",
                           "chunks": tp if variant.endswith("chunked") else 1, "us": None, "tflops": None,
                           "error": None}
                    if variant not in fns:
                        row["error"] = err
                    elif time.monotonic() > deadline:
                        row["error"] = "skipped: --budget-s exhausted"
                    else:
                        try:
                            row["us"] = round(timer(fns[variant]), 3)
                            row["tflops"] = round(tflops(m_pad, shape.n, shape.k, row["us"]), 2)
                        except Exception as exc:  # noqa: BLE001  (one failure must not end the run)
                            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                    rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(f"{model} tp={tp} {shape.name:8s} K={shape.k} N={shape.n}: {time.monotonic() - t0:.1f} s", flush=True)
    return rows


def rehearsal_rows(case_timeout: float, write) -> list[dict]:
    """Rowwise under the three working boundaries, tensorwise under ``sharded``, at tp 2 and 4; ``write(rows)``
    after every launch, so that a run cut short keeps what it measured."""
    from sp_lab.bench.rehearsal import rehearse_numerics

    rows = []
    for quant, boundaries in (("fp8", ("gather_erase", "gather", "sharded")), ("fp8-tensorwise", ("sharded",))):
        for tp in (2, 4):
            t0 = time.monotonic()
            try:
                got = rehearse_numerics("llama-3-8b", tp_size=tp, token_counts=(13, 96), async_tp_min_tokens=64,
                                        boundaries=boundaries, dtype=torch.bfloat16, num_layers=2,
                                        overrides={"quant": quant}, timeout=case_timeout)
                rows += [r.to_dict() | {"quant": quant} for r in got]
            except Exception as exc:  # noqa: BLE001  (the table still gets written)
                rows.append({"quant": quant, "tp": tp, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            print(f"rehearsal {quant} tp {tp}: {time.monotonic() - t0:.1f} s", json.dumps(rows[-1])[:600], flush=True)
            write(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU to check the plumbing")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop timing matmuls after this many seconds")
    parser.add_argument("--skip-rehearsal", action="store_true")
    parser.add_argument("--case-timeout", type=float, default=240.0, help="seconds per rehearsal launch")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if args.cpu_smoke:
        device, configs, models = torch.device("cpu"), [("smoke", 2)], {"smoke": SMOKE_MODEL}
        tokens = [1, 16]
        timer = lambda fn: time_cpu(fn, warmup=1, repeats=3, calls=2, barrier=False).median_us
    else:
        if not torch.cuda.is_available():
            print("bench_matmul_fp8_h200: no CUDA device; pass --cpu-smoke to check the script", file=sys.stderr)
            return 2
        device, configs, models, tokens = torch.device("cuda", 0), CONFIGS, MODELS, TOKENS
        timer = partial(_graph_replay_us, calls=10, replays=5)
    rows = matmul_table(device, configs, models, tokens, timer, start + args.budget_s)
    meta = {**provenance(device), "source": MEASURED, "script": "benchmarks/bench_matmul_fp8_h200.py",
            "argv": sys.argv[1:] if argv is None else argv,
            "method": ("median of 5 CUDA-graph replays of 10 calls each after warm-up; us per call; M padded up to "
                       "a multiple of tp; activation quantisation not included" if device.type == "cuda"
                       else "CPU smoke test: plumbing only, not a measurement"),
            "models": {name: models[name] for name, _ in configs}, "wall_s": round(time.monotonic() - start, 1)}
    (out / "matmul_fp8_single_gpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"{len(rows)} matmul rows, {sum(r['error'] is not None for r in rows)} errors", flush=True)
    if not args.skip_rehearsal and device.type == "cuda":
        t0 = time.monotonic()
        meta_r = {**provenance(device), "source": "rehearsal", "script": "benchmarks/bench_matmul_fp8_h200.py",
                  "what": "2-layer llama-3-8b with FP8 matmuls (bf16 activations) compiled at tp ranks sharing one GPU "
                          "(gloo group, overlapping-device symmetric memory, PyTorch's fused scaled symm_mem ops) "
                          "vs the tp 1 eager FP8 model on the same GPU",
                  "cannot_check": "overlap of communication and compute; CUDA-graph capture of collectives"}

        def write(rows: list[dict]) -> None:
            doc = {"meta": meta_r | {"wall_s": round(time.monotonic() - t0, 1)}, "rows": rows}
            (out / "rehearsal_fp8.json").write_text(json.dumps(doc, indent=1))

        rehearsal_rows(args.case_timeout, write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
