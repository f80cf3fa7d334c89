"""GPU check of the compiler on one device: piecewise compile + CUDA graphs vs eager, numerics and latency.

Run on a CUDA machine: ``python benchmarks/verify_gpu.py`` (writes ``$OUT/verify_gpu.json``). With one GPU the
TP group has one rank, so SP/AsyncTP have no collectives to rewrite (the effective config says so); what this
verifies is the piecewise pipeline, per-piece CUDA-graph capture and replay, and numerics, on the GPU build of
torch. The symmetric-memory fused kernels are exercised by ``benchmarks/bench_matmul_h200.py``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402

import sp_lab  # noqa: E402


def _time_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def main() -> int:
    if not torch.cuda.is_available():
        print("verify_gpu.py needs CUDA", file=sys.stderr)
        return 2
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": []}
    for name, kwargs, dtype in [
        ("toy", {}, torch.float32),
        ("llama-3-8b", {"num_layers": 2}, torch.bfloat16),
    ]:
        model = sp_lab.models.build(name, dtype=dtype, device="cuda", **kwargs)
        for cudagraphs in (False, True):
            config = sp_lab.LabConfig(tp_size=1, enable_sp=False, enable_async_tp=False, cudagraphs=cudagraphs,
                                      async_tp_min_tokens=64, max_num_tokens=2048)
            start = time.perf_counter()
            compiled = sp_lab.compile(model, config)
            for n in (5, 16, 100, 512):
                ids = torch.randint(0, model.spec.vocab_size, (n,), device="cuda")
                with torch.no_grad():
                    want = model(ids)
                got = compiled(ids)
                got = compiled(ids)  # second call replays the captured graphs
                got = compiled(ids)
                err = float((got.float() - want.float()).abs().max())
                eager_ms = _time_ms(lambda: model(ids))
                compiled_ms = _time_ms(lambda: compiled(ids))
                row = {"model": name, "dtype": str(dtype), "cudagraphs": cudagraphs, "num_tokens": n,
                       "max_abs_err": err, "eager_ms": eager_ms, "compiled_ms": compiled_ms,
                       "speedup": eager_ms / compiled_ms, "effective": compiled.effective.to_dict()}
                results["checks"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "effective"}), flush=True)
            results.setdefault("compile_s", []).append((name, cudagraphs, time.perf_counter() - start))
    with open(os.path.join(out_dir, "verify_gpu.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(main())
