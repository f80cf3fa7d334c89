"""The performance model's parts on known inputs (sp_lab.tuning.predict): hand-computed alpha-beta times,
pipelines of known chunk times (fill, contention, drain), GPU scaling, and how a layer is composed."""

from __future__ import annotations

import json

import pytest

from sp_lab.tuning.microbench import tp_matmul_shapes
from sp_lab.tuning.predict import hardware as H
from sp_lab.tuning.predict import kernels as K
from sp_lab.tuning.predict.layer import Target, predict_layers, predict_matmul
from sp_lab.tuning.predict.pipeline import run_pipeline


def test_alpha_beta_by_hand():
    ic = H.Interconnect("t", "test", busbw_gbps=100.0, copy_gbps=50.0, alpha_us=5.0, copy_alpha_us=1.0)
    mb8 = 8e6  # 8 MB over 4 ranks: each rank moves 3/4 of it (6 MB) at 100 GB/s = 60 us
    assert ic.collective_us("all_gather", mb8, 4) == pytest.approx(65.0)
    assert ic.collective_us("reduce_scatter", mb8, 4) == pytest.approx(65.0)
    assert ic.collective_us("all_reduce", mb8, 4) == pytest.approx(125.0)
    assert ic.collective_us("all_reduce", mb8, 1) == 0.0
    assert ic.copy_us(1e6) == pytest.approx(21.0)  # 1 us + 1 MB at 50 GB/s
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        ic.collective_us("broadcast", mb8, 4)
    with pytest.raises(ValueError, match="bandwidths must be > 0"):
        H.Interconnect("bad", "bad", busbw_gbps=0.0, copy_gbps=1.0, alpha_us=0.0, copy_alpha_us=0.0)


def test_hardware_data_names_sources_and_refuses_unknown_gpus():
    for name in H.gpu_names():
        g = H.gpu(name)
        assert g.sources and g.interconnect.sources and g.hbm_gbps > 0
    assert H.gpu("H200").interconnect.name == "nvlink4" and H.gpu("b200").interconnect.name == "nvlink5"
    with pytest.raises(ValueError, match=r"unknown GPU 'h300'; allowed: a100_sxm, b200_sxm, b300_sxm, gb200, gb300, "
                       r"h100-hbm2e, h100_pcie, h100_sxm, h200_sxm, h800, l40s, rtx_pro_6000_server, "
                       r"b200 \(= b200_sxm\), h100 \(= h100_sxm\), h100-pcie \(= h100_pcie\), h200 \(= h200_sxm\)"):
        H.gpu("h300")


@pytest.mark.parametrize(("compute", "copies", "side", "kappa", "want"), [
    # ag: local chunk first; copies back to back from t=0
    ([10, 10, 10], [5, 5], "ag", 1.0, {"total_us": 30, "stall_us": 0, "contention_us": 0, "drain_us": 0}),
    # copies slower than chunks: chunk 1 waits for copy 1 (t=20), chunk 2 for copy 2 (t=40)
    ([10, 10, 10], [20, 20], "ag", 1.0, {"total_us": 50, "stall_us": 20, "contention_us": 0, "drain_us": 0}),
    # contention 2 while the copy runs (0-10): chunk 0 does 5 of its 10 by t=10, ends at 15; chunk 1 15-25
    ([10, 10], [10], "ag", 2.0, {"total_us": 25, "stall_us": 0, "contention_us": 5, "drain_us": 0}),
    # rs: chunk j sent when computed; the local (last) chunk has no copy
    ([10, 10, 10], [5, 5], "rs", 1.0, {"total_us": 30, "stall_us": 0, "contention_us": 0, "drain_us": 0}),
    # rs with slow copies: copy 0 10-25, copy 1 25-40; last matmul ends at 30: 10 us of drain
    ([10, 10, 10], [15, 15], "rs", 1.0, {"total_us": 40, "stall_us": 0, "contention_us": 0, "drain_us": 10}),
])
def test_pipeline_fill_contention_drain(compute, copies, side, kappa, want):
    got = run_pipeline(compute, copies, side, kappa)
    assert got.compute_us == pytest.approx(sum(compute))
    for key, value in want.items():
        assert getattr(got, key) == pytest.approx(value), key


def test_pipeline_refuses_bad_input():
    with pytest.raises(ValueError, match="one copy per non-local chunk"):
        run_pipeline([1, 1], [1, 1], "ag")
    with pytest.raises(ValueError, match="side must be"):
        run_pipeline([1, 1], [1], "xy")
    with pytest.raises(ValueError, match="contention must be >= 1"):
        run_pipeline([1, 1], [1], "ag", 0.5)


@pytest.fixture(scope="module")
def table() -> K.MatmulTable:
    return K.default_table()


def test_kernels_on_the_h200_are_the_measured_rows():
    km = K.KernelModel(K.MatmulTable.from_files(K.SINGLE_GPU_JSON), H.gpu("h200"))
    rows = json.loads(K.SINGLE_GPU_JSON.read_text())["rows"]
    row = {(r["variant"], r["m_padded"]): r["us"] for r in rows
           if r["model"] == "llama-3-70b" and r["tp"] == 8 and r["name"] == "qkv"}
    assert km.mm_us(4096, 1280, 8192) == pytest.approx(row[("mm", 4096)])
    assert km.chunk_us(4096, 1280, 8192, 8) == pytest.approx(row[("mm_chunked", 4096)] / 8)
    # all_gather side: the local shard (m / tp rows) is what gets staged
    assert km.fused_overhead_us("ag", 4096, 1280, 8192, 8) == pytest.approx(row[("fused_ws1", 512)] - row[("mm", 512)])
    assert not km.estimated


def test_kernels_scale_by_memory_and_compute_share(table):
    h200 = H.gpu("h200")
    fast_memory = H.Gpu("x", "x", dict(h200.peak_tflops), h200.hbm_gbps * 2, h200.interconnect)
    base, fast = K.KernelModel(table, h200), K.KernelModel(table, fast_memory)
    assert base.roofline.memory_share(8, 7168, 8192) == 1.0  # 8 rows: the weight read is the time
    assert fast.mm_us(8, 7168, 8192) == pytest.approx(base.mm_us(8, 7168, 8192) / 2)
    share = base.roofline.memory_share(16384, 7168, 8192)
    assert share < 0.5  # compute-bound: doubling memory speed saves only the memory share
    assert fast.mm_us(16384, 7168, 8192) == pytest.approx(base.mm_us(16384, 7168, 8192) * (1 - share / 2))


def test_contention_from_hbm_share(table):
    km = K.KernelModel(table, H.gpu("h200"))
    hbm = H.gpu("h200").hbm_gbps
    # copies in and out take half the HBM: a memory-bound matmul runs at half speed
    assert km.contention(8, 7168, 8192, hbm / 4) == pytest.approx(2.0)
    assert km.contention(8, 7168, 8192, 0.0) == pytest.approx(1.0)
    assert 1.0 < km.contention(16384, 7168, 8192, hbm / 4) < 1.5  # compute-bound: barely


def test_fused_matmul_is_its_pipeline_plus_overhead(table):
    ic = H.Interconnect("t", "test", busbw_gbps=100.0, copy_gbps=100.0, alpha_us=5.0, copy_alpha_us=1.0)
    target = Target.of("h200", interconnect=ic, contention_scale=0.0)
    km = K.KernelModel(table, target.gpu)
    qkv = tp_matmul_shapes("llama-3-70b", 8)[0]
    p = predict_matmul(km, target, qkv, 4096, 8, 8192)
    chunk = km.chunk_us(4096, 1280, 8192, 8)
    copy = 1.0 + 512 * 8192 * 2 / 100e3  # 8 MB shard at 100 GB/s = 83.9 us > chunk: copies set the pace
    # ag: chunk 0 at t=0, chunk i after copy i lands at i*copy: the last chunk starts at 7 * copy
    assert p.pipeline.total_us == pytest.approx(7 * copy + chunk)
    assert p.fused_us == pytest.approx(7 * copy + chunk + km.fused_overhead_us("ag", 4096, 1280, 8192, 8))
    assert p.comm_us == pytest.approx(5.0 + 7 / 8 * 4096 * 8192 * 2 / 100e3)
    assert p.unfused_us == pytest.approx(km.mm_us(4096, 1280, 8192) + p.comm_us)


def test_baseline_layer_by_hand(table):
    ic = H.Interconnect("t", "test", busbw_gbps=100.0, copy_gbps=100.0, alpha_us=5.0, copy_alpha_us=1.0)
    target = Target.of("h200", interconnect=ic)
    rows = predict_layers("llama-3-70b", 8, [1024], target, num_layers=2)
    km = K.KernelModel(table, target.gpu)
    mm = sum(km.mm_us(1024, s.n, s.k) for s in tp_matmul_shapes("llama-3-70b", 8))
    ar = 5.0 + 2 * 7 / 8 * 1024 * 8192 * 2 / 100e3
    norm = 4 * 1024 * 8192 * 2 / (km.roofline.hbm_gbps * 1e3)
    base = rows.filter(rows["variant"] == "baseline").row(0, named=True)
    assert base["latency_us"] == pytest.approx(2 * (mm + 2 * ar + 2 * norm))
    assert base["source"] == "predicted" and base["device_name"] == "predicted: 8x H200 SXM 141GB"
    sp = rows.filter(rows["variant"] == "sp").row(0, named=True)  # same comm, norms on 1/8 of the tokens
    assert sp["norm_us"] == pytest.approx(base["norm_us"] / 8)


def test_fp8_needs_a_measured_table():
    bf16_only = K.MatmulTable.from_files(K.SINGLE_GPU_JSON, K.CHUNKING_TP8_JSON)
    with pytest.raises(ValueError, match="no measured float8 matmul table"):
        K.KernelModel(bf16_only, H.gpu("h200"), "float8_e4m3fn")
    assert "float8" in K.default_table().dtypes()  # the shipped FP8 table (data/h200/matmul_fp8_single_gpu.json)


def test_crossover_is_where_the_variant_wins_from_then_on():
    import polars as pl

    from sp_lab.tuning.predict.crossover import crossover_tokens

    def rows(fused: list[float]) -> pl.DataFrame:
        n = [1, 2, 4, 8]
        return pl.DataFrame({"num_tokens": n * 2, "variant": ["baseline"] * 4 + ["sp+async_tp"] * 4,
                             "latency_us": [10.0] * 4 + fused})
    assert crossover_tokens(rows([20, 9, 11, 9])) == 8  # wins at 2 but loses again at 4: from 8 on
    assert crossover_tokens(rows([9, 9, 9, 9])) == 1
    assert crossover_tokens(rows([20, 20, 20, 11])) is None


def test_per_matmul_rules_compose_the_layer():
    from sp_lab.rules import MatmulRule

    def by_variant(rule) -> dict[tuple[int, str], float]:
        rows = predict_layers("llama-3-70b", 8, [64, 2048, 16384], "h200", num_layers=1, rule=rule)
        return {(r["num_tokens"], r["variant"]): r["latency_us"] for r in rows.iter_rows(named=True)}

    always, never, own = by_variant(MatmulRule.always("fuse")), by_variant(MatmulRule.always("no_fuse")), by_variant(
        "predicted")
    for t in (64, 2048, 16384):
        assert always[(t, "tuned")] == pytest.approx(always[(t, "sp+async_tp")])
        assert never[(t, "tuned")] == pytest.approx(never[(t, "sp")])
        # choosing per matmul can only help: never slower than all-fused or none-fused
        assert own[(t, "tuned")] <= min(own[(t, "sp")], own[(t, "sp+async_tp")]) + 1e-9
    assert own[(16384, "tuned")] < own[(16384, "sp")]  # at 16k tokens some matmuls pay
    with pytest.raises(ValueError, match="rule must be a MatmulRule or 'predicted'"):
        predict_layers("llama-3-70b", 8, [64], "h200", rule="oracle")


def test_an_fp8_layer_asks_the_rule_about_fp8_matmuls():
    """The ``tuned`` curve and the per-matmul training rows carry the operand width: a rule that fuses 1-byte
    operands only fuses every FP8 matmul and no bf16 one."""
    import polars as pl

    from sp_lab.rules import Leaf, MatmulRule, Split
    from sp_lab.tuning import train as T
    from sp_lab.tuning.predict.layer import matmul_rows

    by_width = MatmulRule(Split("dtype_bytes", 1.5, Leaf("fuse"), Leaf("no_fuse")))

    def tuned_fused(dtype: str) -> int:
        rows = predict_layers("llama-3-70b", 8, [2048], Target.of("h200", dtype=dtype), num_layers=1, rule=by_width)
        return rows.filter(pl.col("variant") == "tuned")["n_fused"].item()

    assert (tuned_fused("fp8"), tuned_fused("fp8-tensorwise"), tuned_fused("bfloat16")) == (4, 4, 0)
    shapes = tp_matmul_shapes("llama-3-70b", 8)
    for dtype, width in (("fp8", 1), ("bfloat16", 2)):
        rows = matmul_rows(shapes, [64], 8, 8192, Target.of("h200", dtype=dtype))
        assert T._row_widths(rows) == [width] * 4  # trained and evaluated as this width, not as bf16
        assert T.evaluate_rule(by_width, rows).per_shape["decision"].to_list() == ["fuse" if width == 1 else
                                                                                   "no_fuse"] * 4


def test_fp8_bench_rows_are_read_per_scaling(tmp_path):
    # benchmarks/bench_matmul_fp8_h200.py's layout, with made-up times: each FP8 scaling is its own table, the
    # run's bf16 reference rows are not read, failed rows are dropped.
    qkv = tp_matmul_shapes("llama-3-70b", 8)[0]
    times = {"bf16": 1000.0, "fp8_rowwise": 40.0, "fp8_tensorwise": 30.0, "fp8_rowwise_chunked": 120.0}
    rows = [{"model": "llama-3-70b", "tp": 8, "name": "qkv", "side": "ag", "n": qkv.n, "k": qkv.k, "m": m,
             "m_padded": m, "variant": v, "chunks": 8 if v.endswith("chunked") else 1, "us": us * m / 512, "error": None}
            for m in (8, 64, 512, 4096) for v, us in times.items()]
    rows.append({**rows[0], "m": 16, "m_padded": 16, "variant": "fp8_rowwise", "us": None, "error": "skipped"})
    path = tmp_path / "matmul_fp8_single_gpu.json"
    path.write_text(json.dumps({"meta": {"device": "NVIDIA H200", "torch": "2.11.0", "source": "measured"},
                                "rows": rows}))
    table = K.MatmulTable.from_files(K.SINGLE_GPU_JSON, K.CHUNKING_TP8_JSON, path)
    assert table.dtypes() == ["bfloat16", "float8", "float8_tensorwise"]
    h200 = H.gpu("h200")
    rowwise, tensorwise = K.KernelModel(table, h200, "fp8"), K.KernelModel(table, h200, "fp8-tensorwise")
    assert rowwise.mm_us(512, qkv.n, qkv.k) == pytest.approx(40.0)  # on the H200 itself: the measured row
    assert tensorwise.mm_us(4096, qkv.n, qkv.k) == pytest.approx(240.0)
    assert rowwise.chunk_us(4096, qkv.n, qkv.k, 8) == pytest.approx(960.0 / 8)  # measured chunked rows
    assert tensorwise.chunk_us(4096, qkv.n, qkv.k, 8) == pytest.approx(8 * 30.0 / 8)  # none: 8 x mm(M / 8)
    # the bf16 model is untouched by the FP8 file (its bf16 reference rows were not read)
    bf16 = K.KernelModel(K.MatmulTable.from_files(K.SINGLE_GPU_JSON, K.CHUNKING_TP8_JSON), h200)
    assert K.KernelModel(table, h200).mm_us(512, qkv.n, qkv.k) == pytest.approx(bf16.mm_us(512, qkv.n, qkv.k))
    # the fused op's own cost: the bf16 staging line at the FP8 input's byte count (no FP8 one-rank rows)
    assert rowwise.fused_overhead_us("ag", 4096, qkv.n, qkv.k, 8) == pytest.approx(
        rowwise.staging["ag"].us(512 * qkv.k * 1))
    # the H100 runs the compute-bound share at its own FP8 peak (same as the H200's: 1979 TFLOP/s)
    h100 = K.KernelModel(table, H.gpu("h100"), "fp8")
    assert h100.mm_us(4096, qkv.n, qkv.k) >= rowwise.mm_us(4096, qkv.n, qkv.k)
    with pytest.raises(ValueError, match="unsupported dtype 'fp4'"):
        K.canonical_dtype("fp4")


def test_fp8_roofline_is_fitted_on_its_own_rows():
    # Rows made from a known FP8 roofline (peak 1500 TFLOP/s, above any bf16 peak; 1-byte operands, bf16 output):
    # the fit recovers it, so unmeasured FP8 shapes are not timed at bf16 speed.
    import polars as pl

    def us(m, n, k):
        return 5.0 + max(2 * m * n * k / 1500e6, ((m * k + k * n) + 2 * m * n) / 3500e3)
    shapes = [(1280, 8192), (7168, 8192), (8192, 1024), (8192, 3584)]
    rows = pl.DataFrame([{"m": m, "n": n, "k": k, "variant": "mm", "chunks": 1, "us": us(m, n, k), "dtype": "float8"}
                         for n, k in shapes for m in (2 ** i for i in range(15))])
    fit = K.fit_roofline(K.MatmulTable(rows), "fp8")
    assert fit.peak_tflops == pytest.approx(1500, rel=0.03) and fit.hbm_gbps == pytest.approx(3500, rel=0.03)
    with pytest.raises(ValueError, match="too few measured bfloat16 mm rows"):
        K.fit_roofline(K.MatmulTable(rows))
