"""Numerics of the multi-rank GPU path rehearsed on one GPU: tp 2 and 4 ranks sharing it, every boundary.

``python benchmarks/h200/rehearsal_numerics.py [--quick] [--case-timeout S]`` on a CUDA machine writes
``$OUT/rehearsal_numerics.json``: rows ``model, tp, boundary, num_tokens, max_abs_err,
fused_all_gather_matmul, fused_matmul_reduce_scatter`` (and the eager tp-way error, for scale), all
``source="rehearsal"``. Models: the toy (fp32; 4 KV heads so that tp 4 divides them) and a 2-layer
Llama-3-8B shape (bf16). ``--case-timeout`` bounds each (model, tp) launch (default 600 s): a stuck case
then ends with the launcher's ``LaunchTimeout``, which names the stuck ranks with their Python stacks. Exits 1 if an error is beyond its bound or an SP row has no fused symm_mem op.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import provenance

from sp_lab.bench.rehearsal import CASES, rehearse_case


def _write(out_dir: str, rows: list[dict], failures: list[str]) -> None:
    doc = {"meta": provenance(source="rehearsal", what="tp-way compiled (SP + AsyncTP, symm_mem fused ops) vs tp 1 "
                              "eager logits, all ranks on one GPU (gloo group, overlapping-device symmetric memory)",
                              cannot_check="overlap of communication and compute; CUDA-graph capture of collectives",
                              failures=failures),
           "rows": rows}
    with open(os.path.join(out_dir, "rehearsal_numerics.json"), "w") as f:
        json.dump(doc, f, indent=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the toy at tp 2 only")
    parser.add_argument("--case-timeout", type=float, default=600.0, help="seconds per (model, tp) launch")
    args = parser.parse_args()
    quick = args.quick
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    rows, failures = [], []
    for case in list(CASES.values())[:1] if quick else CASES.values():
        name, bound = case.model, case.bound
        for tp in (2,) if quick else (2, 4):
            start = time.perf_counter()
            got = rehearse_case(case, tp, timeout=args.case_timeout)
            for row in got:
                d = row.to_dict() | {"bound": bound}
                rows.append(d)
                print(json.dumps(d), flush=True)
                if row.error and row.boundary != "none":
                    failures.append(f"{name} tp{tp} {row.boundary} {row.num_tokens}: {row.error}")
                if row.max_abs_err is not None and row.max_abs_err > bound:
                    failures.append(f"{name} tp{tp} {row.boundary} {row.num_tokens}: err {row.max_abs_err} > {bound}")
                if row.sp_active and not row.error and not (row.fused_all_gather_matmul and row.fused_matmul_reduce_scatter):
                    failures.append(f"{name} tp{tp} {row.boundary} {row.num_tokens}: SP on but fused ops missing")
            print(f"{name} tp {tp}: {time.perf_counter() - start:.1f} s", flush=True)
            _write(out_dir, rows, failures)  # after every case: a run cut short keeps what it measured
    print("rehearsal:", "OK" if not failures else "FAILED\n  " + "\n  ".join(failures), flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
