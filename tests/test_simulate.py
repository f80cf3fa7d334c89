"""The what-if latency model (sp_lab.tuning.simulate) against the measured H200 tables it ships with."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from sp_lab.rules import MatmulRule
from sp_lab.tuning import simulate as S
from sp_lab.tuning.microbench import tp_matmul_shapes

ROOT = Path(__file__).resolve().parents[1]
TOKENS = [2**i for i in range(15)]


@pytest.fixture(scope="module")
def table() -> S.MatmulTable:
    return S.MatmulTable.from_files(S.CHUNKING_TP8_JSON)


def test_alpha_beta_ring_factors():
    c = S.AlphaBeta("test", alpha_us=5.0, beta_gbps=100.0)
    nbytes = 8 * 1e6  # 8 MB over 4 ranks
    assert c.collective_us("all_gather", nbytes, 4) == pytest.approx(5.0 + 0.75 * 80.0)
    assert c.collective_us("reduce_scatter", nbytes, 4) == pytest.approx(65.0)
    assert c.collective_us("all_reduce", nbytes, 4) == pytest.approx(5.0 + 1.5 * 80.0)
    assert c.collective_us("all_reduce", nbytes, 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        c.collective_us("broadcast", nbytes, 4)
    with pytest.raises(ValueError, match="beta_gbps > 0"):
        S.AlphaBeta("bad", alpha_us=1.0, beta_gbps=0.0)
    assert "assumption" in S.H200_NVLINK.source


def test_table_reproduces_measured_points_and_interpolates(table):
    raw = json.loads(S.CHUNKING_TP8_JSON.read_text())["rows"]
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
    for r in json.loads(S.CHUNKING_TP8_JSON.read_text())["rows"]:
        est = 8 * table.mm_us(r["M"] // 8, r["N"], r["K"])
        ratios.append(est / r["chunked_us"])
    assert all(0.7 < x < 1.35 for x in ratios)
    assert abs(statistics.median(ratios) - 1) < 0.1


def test_roofline_fit_is_close_to_the_measurements(table):
    fit = S.fit_roofline(table)
    mm = table.rows.filter(pl.col("variant") == "mm")
    errs = [fit.mm_us(m, n, k) / us for m, n, k, us in mm.select("m", "n", "k", "us").iter_rows()]
    assert all(0.7 < e < 1.35 for e in errs)
    assert 500 < fit.peak_tflops < 990


def test_table_refuses_simulated_rows(table):
    with pytest.raises(ValueError, match="measured times only"):
        S.MatmulTable(table.rows.with_columns(source=pl.lit("simulated")))


def test_predicted_sweep_is_labelled_and_has_the_expected_shape(table):
    sweep = S.predict_sweep("llama-3-70b", 8, TOKENS, table)
    assert (sweep["source"] == "simulated").all() and (sweep["timing_method"] == "simulated").all()
    assert sweep["device_name"].str.starts_with("simulated").all()
    assert set(sweep["variant"]) == {"baseline", "sp", "sp+async_tp"} and sweep["num_layers"][0] == 80
    wide = sweep.pivot(on="variant", index="num_tokens", values="latency_us").sort("num_tokens")
    small, large = wide.row(0, named=True), wide.row(-1, named=True)
    # Decode: the 8-way chunking penalty dominates (docs/measured-h200.md), fusion loses badly.
    assert small["sp+async_tp"] > 2 * small["baseline"]
    # Prefill at 16K tokens: the hidden communication outweighs the penalty.
    assert large["sp+async_tp"] < large["sp"] < large["baseline"]
    # Latency grows with tokens for every variant, up to the measured table's own jitter (the chunked
    # tp=8 times dip by ~8% between M=32 and M=128, which costs the whole step < 1%).
    for v in ("baseline", "sp", "sp+async_tp"):
        assert (wide[v].diff().drop_nulls() / wide[v][1:] >= -0.01).all()


def test_tuned_variant_follows_the_rule(table):
    never = S.predict_sweep("llama-3-70b", 8, [16, 4096], table, rule=MatmulRule.always("no_fuse"))
    always = S.predict_sweep("llama-3-70b", 8, [16, 4096], table, rule=MatmulRule.always("fuse"))

    def lat(df, variant):
        return df.filter(pl.col("variant") == variant).sort("num_tokens")["latency_us"].to_list()

    assert lat(never, "tuned") == pytest.approx(lat(never, "sp"))
    assert lat(always, "tuned") == pytest.approx(lat(always, "sp+async_tp"))


def test_other_interconnect_and_missing_shapes(table):
    pcie = S.predict_sweep("llama-3-70b", 8, [4096], table, comm=S.PCIE5)
    nvl = S.predict_sweep("llama-3-70b", 8, [4096], table)
    base = pl.col("variant") == "baseline"
    assert pcie.filter(base)["comm_us"][0] > 5 * nvl.filter(base)["comm_us"][0]
    with pytest.raises(KeyError, match="bench_matmul_h200"):
        S.predict_sweep("llama-3-8b", 2, [16], table)  # shapes the tp=8 70B table does not hold
    est = S.predict_sweep("llama-3-8b", 2, [16], S.fit_roofline(table))
    assert est["device_name"].str.contains("roofline").all()


def test_compare_to_measured_never_mixes_labels(table):
    pred = S.predict_sweep("llama-3-70b", 8, [64, 4096], table)
    measured = pred.with_columns(source=pl.lit("measured"), latency_us=pl.col("latency_us") * 2,
                                 fusion_missing=pl.lit(False))
    cmp = S.compare_to_measured(pred, measured)
    assert cmp.height == 6 and cmp["rel_error"].to_list() == pytest.approx([-0.5] * 6)
    with pytest.raises(ValueError, match="source='simulated'"):
        S.compare_to_measured(measured, measured)
    with pytest.raises(ValueError, match="source='measured'"):
        S.compare_to_measured(pred, pred)
    missing = measured.with_columns(fusion_missing=pl.col("variant") == "sp+async_tp")
    assert S.compare_to_measured(pred, missing).height == 4


def test_fixture_is_reproducible_from_its_generator():
    gen = ROOT / "tests" / "data" / "make_tuning_fixture.py"
    code = f"import runpy, json; print(json.dumps(runpy.run_path({str(gen)!r})['build']()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    shipped = json.loads((ROOT / "tests" / "data" / "tuning_fixture_rows.json").read_text())
    assert json.loads(out) == shipped
    assert {r["source"] for r in shipped["rows"]} == {"simulated"} and "NOT a measurement" in shipped["meta"]["what"]


def test_default_table_uses_shipped_data():
    t = S.MatmulTable.default()
    assert "H200" in t.provenance["device"]
    assert set(t.shapes()) >= {(s.n, s.k) for s in tp_matmul_shapes("llama-3-70b", 8)}
