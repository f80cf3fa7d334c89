"""Regenerate ``tuning_fixture_rows.json``: a SYNTHETIC fused-vs-unfused table for the tuning tests.

Nothing in it is a measurement. It is the what-if model of ``sp_lab.tuning.simulate`` evaluated on
the TP shard shapes of the shipped model presets, so that "the rule trained on the fixture reproduces
the fixture's decisions" is a meaningful test with a known answer:

- matmul times: a roofline (``fit_roofline``) fitted to the MEASURED single-H200 table
  ``data/h200/gemm_chunking_tp8.json`` (Llama-3-70B TP=8 shapes), so times have the right scale;
- fused kernel: ``tp`` chunk matmuls overlapped with its collective, ``max(chunked, comm) + sync``;
- communication: the alpha-beta model ``H200_NVLINK`` (its constants are assumptions, see simulate.py).

Every row says ``source="simulated"``. Run from the repository root:

    python tests/data/make_tuning_fixture.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sp_lab.tuning.microbench import _spec_dims, tp_matmul_shapes
from sp_lab.tuning.simulate import (
    CHUNKING_TP8_JSON,
    H200_NVLINK,
    MatmulTable,
    fit_roofline,
    predict_matmul_rows,
)

OUT = Path(__file__).with_name("tuning_fixture_rows.json")
MODELS = ("llama-2-7b", "llama-3-8b", "llama-3-70b", "mistral-7b", "qwen2.5-7b")
TPS = (2, 4, 8)
TOKENS = [2**i for i in range(15)]  # 1 .. 16384


def build() -> dict:
    """The fixture as ``{"meta": ..., "rows": [...]}`` (deterministic)."""
    roofline = fit_roofline(MatmulTable.from_files(CHUNKING_TP8_JSON))
    frames = []
    for model in MODELS:
        hidden = _spec_dims(model)["hidden_size"]
        for tp in TPS:
            try:
                shapes = tp_matmul_shapes(model, tp)
            except ValueError:  # e.g. 28 heads do not split 8 ways: that configuration does not exist
                continue
            frames.append(predict_matmul_rows(shapes, TOKENS, tp, roofline, hidden_size=hidden, comm=H200_NVLINK)
                          .with_columns(model=pl.lit(model)))
    rows = pl.concat(frames).select(
        "model", "name", "side", "m", "n", "k", "tp",
        pl.col("unfused_us", "fused_us", "mm_us", "chunked_us", "comm_us").round(3), "source")
    meta = {
        "what": "SYNTHETIC fixture for tests (source=simulated): NOT a measurement",
        "generator": "tests/data/make_tuning_fixture.py",
        "matmul_model": f"roofline fitted to data/h200/gemm_chunking_tp8.json: {roofline}",
        "comm_model": f"{H200_NVLINK.name}: alpha {H200_NVLINK.alpha_us} us, beta {H200_NVLINK.beta_gbps} GB/s, "
                      f"sync {H200_NVLINK.sync_us} us ({H200_NVLINK.source})",
        "fused_us": "max(tp chunk matmuls, collective) + sync",
        "unfused_us": "one matmul + its collective (all_gather before AG side, reduce_scatter after RS side)",
        "models": list(MODELS), "tp": list(TPS), "tokens": TOKENS,
    }
    return {"meta": meta, "rows": rows.to_dicts()}


if __name__ == "__main__":
    OUT.write_text(json.dumps(build(), indent=0) + "\n")
    print(f"wrote {OUT}")
