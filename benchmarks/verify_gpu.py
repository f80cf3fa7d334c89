"""GPU check of the compiler on one device: piecewise compile + CUDA graphs vs eager, numerics and latency.

Run on a CUDA machine: ``python benchmarks/verify_gpu.py`` (writes ``$OUT/verify_gpu.json``; exit 1 if any
error is beyond its bound). With one GPU the TP group has one rank, so SP/AsyncTP have no collectives to
rewrite (the effective config says so); what this verifies is the piecewise pipeline, every CUDA-graph mode's
capture and replay, and numerics, on the GPU build of torch. Numerics at tp >= 2 are checked by the one-GPU
rehearsal (``benchmarks/h200/rehearsal_numerics.py``); the symm_mem fused kernels' speed by
``benchmarks/bench_matmul_h200.py``.

Method: Inductor's start-up (imports, compile workers) is paid once before anything is timed. Per model and
mode, ``compile_s`` is the time of the first calls at every token count (compile, warm-up, capture) and
nothing else; latencies are measured afterwards (median of synchronised calls, CUDA events).
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch

import sp_lab
from sp_lab.bench.timing import time_cuda

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "h200"))
from provenance import provenance  # benchmarks/h200/provenance.py

TOKENS = (5, 16, 100, 512)
# (model, build kwargs, dtype, bound on max |compiled - eager|). fp32: Inductor's fusions reorder sums
# (~1e-7 seen). bf16: a 2-layer Llama-3-8B shape has logits up to ~5 whose bf16 spacing is 2**-5; compiled
# and eager round differently (0.03-0.08 seen), 0.25 leaves room without hiding a wrong kernel (O(1) errors).
MODELS = [
    ("toy", {}, torch.float32, 1e-4),
    ("llama-3-8b", {"num_layers": 2}, torch.bfloat16, 0.25),
]
MODES = ("none", "piecewise", "full_and_piecewise")


def _time_ms(fn) -> float:
    """Median of 20 synchronised calls (CUDA events), host overhead included: what a caller waits."""
    return time_cuda(fn, warmup=3, repeats=20, cuda_graph=False, barrier=False).median_us / 1e3


def main() -> int:
    if not torch.cuda.is_available():
        print("verify_gpu.py needs CUDA", file=sys.stderr)
        return 2
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    torch.compile(lambda x: x + 1)(torch.ones(4, device="cuda"))  # Inductor start-up, outside every comparison
    results = {"meta": provenance(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cuda": torch.version.cuda, "inductor_startup_s": time.perf_counter() - start, "checks": [],
               "compile_s": [], "failures": []}
    for name, kwargs, dtype, bound in MODELS:
        model = sp_lab.models.build(name, dtype=dtype, device="cuda", **kwargs)
        ids = {n: torch.randint(0, model.spec.vocab_size, (n,), device="cuda") for n in TOKENS}
        with torch.no_grad():
            want = {n: model(ids[n]).float() for n in TOKENS}
        for mode in MODES:
            config = sp_lab.LabConfig(tp_size=1, enable_sp=False, enable_async_tp=False, cudagraph_mode=mode,
                                      async_tp_min_tokens=64, max_num_tokens=2048)
            compiled = sp_lab.compile(model, config)
            start = time.perf_counter()
            for n in TOKENS:
                for _ in range(3):  # compile / warm-up, capture, first replay
                    compiled(ids[n])
            torch.cuda.synchronize()
            results["compile_s"].append({"model": name, "cudagraph_mode": mode, "s": time.perf_counter() - start})
            for n in TOKENS:
                fresh = torch.randint(0, model.spec.vocab_size, (n,), device="cuda")  # replays follow new inputs
                with torch.no_grad():
                    err = max(float((compiled(ids[n]).float() - want[n]).abs().max()),
                              float((compiled(fresh).float() - model(fresh).float()).abs().max()))
                eager_ms = _time_ms(lambda x=ids[n], m=model: m(x))
                compiled_ms = _time_ms(lambda x=ids[n], c=compiled: c(x))
                row = {"model": name, "dtype": str(dtype), "cudagraph_mode": mode, "num_tokens": n,
                       "max_abs_err": err, "bound": bound, "eager_ms": eager_ms, "compiled_ms": compiled_ms,
                       "speedup": eager_ms / compiled_ms, "effective": compiled.effective.to_dict()}
                results["checks"].append(row)
                if not err <= bound:  # also catches NaN
                    results["failures"].append(f"{name} {mode} {n} tokens: max_abs_err {err} > {bound}")
                print(json.dumps({k: v for k, v in row.items() if k != "effective"}), flush=True)
    with open(os.path.join(out_dir, "verify_gpu.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print("verify_gpu:", "OK" if not results["failures"] else "FAILED\n  " + "\n  ".join(results["failures"]))
    return 0 if not results["failures"] else 1


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
