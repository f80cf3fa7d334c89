"""The performance model's rows in the layouts others read (sp_lab.tuning.predict): the measured H200 tables
it is built on, a whole sweep (the tuner's demo replay), per-matmul training rows (the rule-training fixture),
and the prediction beside measured rows. One model: every row here says ``source="predicted"``."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from sp_lab.tuning.microbench import tp_matmul_shapes
from sp_lab.tuning.predict import kernels as K
from sp_lab.tuning.predict.hardware import interconnect
from sp_lab.tuning.predict.layer import Target, matmul_rows, predict_layers
from sp_lab.tuning.predict.measured import compare_to_measured

ROOT = Path(__file__).resolve().parents[1]
TOKENS = [2**i for i in range(15)]


@pytest.fixture(scope="module")
def table() -> K.MatmulTable:
    return K.MatmulTable.from_files(K.CHUNKING_TP8_JSON)


@pytest.fixture(scope="module")
def sweep() -> pl.DataFrame:
    # the modelled path (H200 tables, alpha-beta): what these checks are about, with or without collected tables
    return predict_layers("llama-3-70b", 8, TOKENS, Target.of("h200", collected_tables=False))


def test_table_reproduces_measured_points_and_interpolates(table):
    raw = json.loads(K.CHUNKING_TP8_JSON.read_text())["rows"]
    for r in raw:
        assert table.mm_us(r["M"], r["N"], r["K"]) == pytest.approx(r["full_us"])
        assert table.chunked_us(r["M"], r["N"], r["K"], 8) == (pytest.approx(r["chunked_us"]), "measured_chunked")
    lo, hi = table.mm_us(1024, 1280, 8192), table.mm_us(2048, 1280, 8192)
    assert lo < table.mm_us(1500, 1280, 8192) < hi
    assert table.mm_us(1, 1280, 8192) == table.mm_us(8, 1280, 8192)  # flat below the table (launch-bound)
    with pytest.raises(KeyError, match="no measured mm rows for N=999"):
        table.mm_us(8, 999, 8192)


def test_chunked_time_is_tp_small_matmuls(table):
    # The fallback for shapes without measured chunked rows (tp x mm(M/tp)) against the measured ones.
    ratios = []
    for r in json.loads(K.CHUNKING_TP8_JSON.read_text())["rows"]:
        est = 8 * table.mm_us(r["M"] // 8, r["N"], r["K"])
        ratios.append(est / r["chunked_us"])
    assert all(0.7 < x < 1.35 for x in ratios)
    assert abs(statistics.median(ratios) - 1) < 0.1


def test_roofline_fit_is_close_to_the_measurements(table):
    fit = K.fit_roofline(table)
    mm = table.rows.filter(pl.col("variant") == "mm")
    errs = [fit.mm_us(m, n, k) / us for m, n, k, us in mm.select("m", "n", "k", "us").iter_rows()]
    assert all(0.7 < e < 1.35 for e in errs)
    assert 500 < fit.peak_tflops < 990


def test_table_refuses_model_rows(table):
    with pytest.raises(ValueError, match="measured times only"):
        K.MatmulTable(table.rows.with_columns(source=pl.lit("predicted")))


def test_predicted_sweep_is_labelled_and_has_the_expected_shape(sweep):
    assert (sweep["source"] == "predicted").all() and (sweep["timing_method"] == "predicted (graph)").all()
    assert sweep["device_name"].str.starts_with("predicted: 8x H200").all()
    assert set(sweep["variant"]) == {"baseline", "sp", "sp+async_tp"} and sweep["num_layers"][0] == 80
    wide = sweep.pivot(on="variant", index="num_tokens", values="latency_us").sort("num_tokens")
    small, large = wide.row(0, named=True), wide.row(-1, named=True)
    # Decode: the 8-way chunking penalty and the fused op's own cost dominate, fusion loses badly.
    assert small["sp+async_tp"] > 2 * small["baseline"]
    # Prefill at 16K tokens: the hidden communication outweighs the penalty.
    assert large["sp+async_tp"] < large["sp"] < large["baseline"]
    # Latency grows with tokens for every variant, up to the measured chunked table's own dips: its tp=8
    # chunked times fall by up to 15% between M=16 and M=128 (one H200, CUDA-graph replay), which the fused
    # variant, made of chunked matmuls, shows as dips of up to 4% of the step there.
    for v, jitter in (("baseline", 0.0), ("sp", 0.0), ("sp+async_tp", 0.04)):
        assert (wide[v].diff().drop_nulls() / wide[v][1:] >= -jitter).all(), v


def test_other_interconnect_and_unmeasured_shapes(sweep):
    pcie = predict_layers("llama-3-70b", 8, [4096], Target.of("h200", interconnect=interconnect("pcie5")))
    base = pl.col("variant") == "baseline"
    nvl = sweep.filter(pl.col("num_tokens") == 4096)
    assert pcie.filter(base)["comm_us"][0] > 5 * nvl.filter(base)["comm_us"][0]
    # The measured tables hold Llama-3-70B/8B shard shapes; Llama-2-7B's come from the roofline fit, and say so.
    assert nvl["estimated_shapes"][0] == "none"
    est = predict_layers("llama-2-7b", 2, [16], Target.of("h200", collected_tables=False))
    assert est["estimated_shapes"][0] == "4096x5504, 6144x4096, 11008x4096"


def test_matmul_rows_are_the_layers_own_numbers():
    # One model: the per-matmul training rows are exactly the matmuls the layer adds up (sp: unfused matmuls,
    # sp+async_tp: fused ones), and the norms are the rest.
    shapes = tp_matmul_shapes("llama-3-70b", 8)
    rows = matmul_rows(shapes, [64, 4096], 8, 8192)
    layer = predict_layers("llama-3-70b", 8, [64, 4096], "h200", num_layers=1)
    for t in (64, 4096):
        mm = rows.filter(pl.col("m") == t)
        sp, fused = (layer.filter((pl.col("num_tokens") == t) & (pl.col("variant") == v)).row(0, named=True)
                     for v in ("sp", "sp+async_tp"))
        assert sp["matmul_us"] + sp["comm_us"] == pytest.approx(mm["unfused_us"].sum())
        assert fused["matmul_us"] == pytest.approx(mm["fused_us"].sum()) and fused["comm_us"] == 0.0
    assert set(rows["source"]) == {"predicted"} and not rows["estimated"].any()
    fitted = matmul_rows(shapes, [64], 8, 8192, measured_shapes=False)
    assert fitted["estimated"].all() and fitted["mm_us"].to_list() != rows.filter(pl.col("m") == 64)["mm_us"].to_list()


def test_compare_to_measured_never_mixes_labels(sweep):
    pred = sweep.filter(pl.col("num_tokens").is_in([64, 4096]))
    measured = pred.with_columns(source=pl.lit("measured"), latency_us=pl.col("latency_us") * 2,
                                 fusion_missing=pl.lit(False))
    cmp = compare_to_measured(pred, measured)
    assert cmp.height == 6 and cmp["rel_error"].to_list() == pytest.approx([-0.5] * 6)
    with pytest.raises(ValueError, match="source='predicted'"):
        compare_to_measured(measured, measured)
    with pytest.raises(ValueError, match="source='measured'"):
        compare_to_measured(pred, pred)
    missing = measured.with_columns(fusion_missing=pl.col("variant") == "sp+async_tp")
    assert compare_to_measured(pred, missing).height == 4


def test_fixture_is_reproducible_from_its_generator():
    gen = ROOT / "tests" / "data" / "make_tuning_fixture.py"
    code = f"import runpy, json; print(json.dumps(runpy.run_path({str(gen)!r})['build']()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    shipped = json.loads((ROOT / "tests" / "data" / "tuning_fixture_rows.json").read_text())
    assert json.loads(out) == shipped
    assert {r["source"] for r in shipped["rows"]} == {"predicted"} and "NOT a measurement" in shipped["meta"]["what"]


def test_default_table_uses_shipped_data():
    t = K.MatmulTable.default()
    assert "H200" in t.provenance["device"]
    assert set(t.shapes()) >= {(s.n, s.k) for s in tp_matmul_shapes("llama-3-70b", 8)}
