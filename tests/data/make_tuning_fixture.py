"""Regenerate ``tuning_fixture_rows.json``: a SYNTHETIC fused-vs-unfused table for the tuning tests.

Nothing in it is a measurement. It is the performance model (``sp_lab.tuning.predict``, per-matmul rows from
:func:`~sp_lab.tuning.predict.layer.matmul_rows`) evaluated on the TP shard shapes of the shipped model
presets for 2-8 H200s, so that "the rule trained on the fixture reproduces the fixture's decisions" is a
meaningful test with a known answer:

- matmul times: a roofline fitted to the MEASURED single-H200 tables under ``data/h200/`` for every
  shape (``measured_shapes=False``: one smooth function of the shape, so a tree can learn it; reading the
  measured rows where they exist makes the fixture switch between measurement and fit from shape to shape);
- fused kernel: its chunk pipeline (fill, contention, drain) plus the fused op's own cost (a line fitted to
  the one-rank H200 measurements of each side);
- communication: the alpha-beta model of H200 NVLink in ``data/hardware.json`` (sources there).

Every row says ``source="predicted"``. Run from the repository root:

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
from sp_lab.tuning.predict.layer import Target, matmul_rows

OUT = Path(__file__).with_name("tuning_fixture_rows.json")
MODELS = ("llama-2-7b", "llama-3-8b", "llama-3-70b", "mistral-7b", "qwen2.5-7b")
TPS = (2, 4, 8)
TOKENS = [2**i for i in range(15)]  # 1 .. 16384


def build() -> dict:
    """The fixture as ``{"meta": ..., "rows": [...]}`` (deterministic)."""
    target = Target.of("h200")
    frames = []
    for model in MODELS:
        hidden = _spec_dims(model)["hidden_size"]
        for tp in TPS:
            try:
                shapes = tp_matmul_shapes(model, tp)
            except ValueError:  # e.g. 28 heads do not split 8 ways: that configuration does not exist
                continue
            frames.append(matmul_rows(shapes, TOKENS, tp, hidden, target, measured_shapes=False).with_columns(model=pl.lit(model)))
    rows = pl.concat(frames).select(
        "model", "name", "side", "m", "n", "k", "tp",
        pl.col("unfused_us", "fused_us", "mm_us", "chunked_us", "comm_us", "overhead_us").round(3), "source")
    ic = target.interconnect
    meta = {
        "what": "SYNTHETIC fixture for tests (source=predicted): NOT a measurement",
        "generator": "tests/data/make_tuning_fixture.py",
        "model": "sp_lab.tuning.predict.layer.matmul_rows(measured_shapes=False), graph timing, bf16",
        "gpu": target.gpu.label,
        "interconnect": f"{ic.label}: busbw {ic.busbw_gbps} GB/s, alpha {ic.alpha_us} us, copy {ic.copy_gbps} GB/s "
                        f"+ {ic.copy_alpha_us} us ({ic.assumption})",
        "fused_us": "chunk pipeline (fill, contention, drain) + the fused op's own cost measured on one H200",
        "unfused_us": "one matmul + its collective (all_gather before AG side, reduce_scatter after RS side)",
        "models": list(MODELS), "tp": list(TPS), "tokens": TOKENS,
    }
    return {"meta": meta, "rows": rows.to_dicts()}


if __name__ == "__main__":
    OUT.write_text(json.dumps(build(), indent=0) + "\n")
    print(f"wrote {OUT}")
