"""The collected multi-GPU tables the performance model reads (sp_lab.tuning.predict.collected): rows read back
equal the shipped parquet values (message sizes in elements), interpolated values lie between their neighbours,
vLLM's custom / symmetric-memory / NCCL all-reduce choice, the AIConfigurator cross-check's arithmetic and the
step-latency rows others consume. Pure polars: no torch.compile."""

from __future__ import annotations

import polars as pl
import pytest

from sp_lab.tuning.predict import collected as C
from sp_lab.tuning.predict import crosscheck as X
from sp_lab.tuning.predict.layer import Target, baseline_all_reduce
from sp_lab.tuning.predict.steps import STEP_COLUMNS, step_latency_rows

needs_tables = pytest.mark.skipif(not C.available(), reason=f"aiconfigurator-core not installed: {C.INSTALL_HINT}")
MiB = 1 << 20


def _parquet(system: str, kind: str) -> pl.DataFrame:
    path, _ = C.table_path(system, kind)
    return pl.read_parquet(path)


@needs_tables
def test_nccl_rows_read_back_in_elements():
    rows = _parquet("h200_sxm", "nccl")
    table = C.CollectiveTable.load("h200_sxm")
    for op, dtype, width in (("all_reduce", "half", 2), ("all_gather", "half", 2), ("reduce_scatter", "int8", 1)):
        row = rows.filter((pl.col("op_name") == op) & (pl.col("nccl_dtype") == dtype) & (pl.col("num_gpus") == 8)
                          & (pl.col("message_size") == 1 << 20)).row(0, named=True)
        # message_size counts elements: a tensor of 2^20 half elements is 2 MiB
        hit = table.latency(op, (1 << 20) * width, 8, width)
        assert hit.grid == C.ON_GRID and hit.us == pytest.approx(1e3 * row["latency"])


@needs_tables
def test_vllm_all_reduce_rows_read_back_and_interpolate():
    rows = _parquet("h200_sxm", "vllm_allreduce").filter(pl.col("num_gpus") == 8)
    table = C.VllmAllReduceTable.load("h200_sxm")
    for backend, graph in (("vllm_graph", True), ("vllm_eager", False)):
        at = {r["message_size"]: r["latency"] for r in rows.filter(pl.col("backend") == backend).iter_rows(named=True)}
        assert table.latency(2 * 65536, 8, graph=graph).us == pytest.approx(1e3 * at[65536])
        mid = table.latency(2 * 3 * 65536, 8, graph=graph)  # 196608 elements: between 131072 and 262144
        low, high = sorted((1e3 * at[131072], 1e3 * at[262144]))
        assert mid.grid == C.INTERPOLATED and low <= mid.us <= high


@needs_tables
def test_gemm_rows_read_back_and_interpolate_and_flag_outside_the_grid():
    rows = _parquet("h200_sxm", "gemm").filter((pl.col("gemm_dtype") == "bfloat16")
                                               & (pl.col("kernel_source") == "torch.nn.functional.linear"))
    gemm = C.GemmTable.load("h200_sxm", "bfloat16")

    def parquet_us(m: int, n: int, k: int) -> float:
        return 1e3 * rows.filter((pl.col("m") == m) & (pl.col("n") == n) & (pl.col("k") == k))["latency"].median()

    on = gemm.latency(4096, 1024, 8192)
    assert on.grid == C.ON_GRID and on.us == pytest.approx(parquet_us(4096, 1024, 8192))
    # Llama-3-70B's qkv shard at tp 8 (N = 1280) lies between the grid's N = 1024 and 1536
    qkv = gemm.latency(4096, 1280, 8192)
    assert qkv.grid == C.INTERPOLATED and parquet_us(4096, 1024, 8192) < qkv.us < parquet_us(4096, 1536, 8192)
    beyond = gemm.latency(65536, 1024, 8192)  # past the largest m: scaled from the edge, and said so
    assert beyond.outside and beyond.us == pytest.approx(2 * parquet_us(32768, 1024, 8192))


@pytest.mark.parametrize(("capability", "tp", "nbytes", "nvlink", "impl"), [
    ("9.0", 8, 128 * 1024, True, C.CUSTOM),      # below CUSTOM_ALL_REDUCE_MAX_SIZES["9.0"][8] = 256 KiB
    ("9.0", 8, 256 * 1024, True, C.SYMM_MEM),    # the limit itself is not below it
    ("9.0", 8, 8 * MiB, True, C.SYMM_MEM),       # below SYMM_MEM_ALL_REDUCE_MAX_SIZES["9.0"][8] = 64 MiB
    ("9.0", 8, 64 * MiB, True, C.NCCL),
    ("9.0", 2, 4 * MiB, True, C.CUSTOM),         # min(64 MiB, CustomAllreduce's 8 MiB buffer)
    ("9.0", 2, 8 * MiB, True, C.SYMM_MEM),
    ("8.0", 8, 4 * MiB, True, C.CUSTOM),         # no per-architecture entry: the 8 MiB buffer, no symm-mem
    ("8.0", 8, 8 * MiB, True, C.NCCL),
    ("8.9", 8, 1024, False, C.NCCL),             # more than two PCIe-only GPUs: custom all-reduce disabled
    ("8.9", 2, 1024, False, C.CUSTOM),           # two PCIe GPUs: allowed
    ("10.0", 8, 2 * MiB, True, C.SYMM_MEM),      # SM 10.0 at 8 GPUs: custom below 1 MiB, symm-mem below 128 MiB
])
def test_vllm_all_reduce_choice(capability, tp, nbytes, nvlink, impl):
    assert C.vllm_all_reduce_impl(capability, tp, nbytes, nvlink=nvlink) == impl


@needs_tables
def test_baseline_all_reduce_reads_the_table_vllm_would_use():
    target = Target.of("h200_sxm")
    small, impl, hit = baseline_all_reduce(target, 64 * 1024, 8)  # 32K bf16 elements
    assert impl == C.CUSTOM and "vLLM" in hit.table
    assert small == pytest.approx(target.tables.vllm_all_reduce.latency(64 * 1024, 8).us)
    big, impl, hit = baseline_all_reduce(target, 128 * MiB, 8)
    assert impl == C.NCCL and "NCCL" in hit.table
    assert big == pytest.approx(target.tables.nccl.latency("all_reduce", 128 * MiB, 8, 2).us)


def test_without_the_package_the_prediction_says_how_to_get_the_tables(monkeypatch):
    monkeypatch.setattr(C, "data_root", lambda: None)
    target = Target.of("h200_sxm")
    assert target.tables is None and C.INSTALL_HINT in target.tables_note
    assert target.provenance().startswith("modelled: matmuls") and C.INSTALL_HINT in target.provenance()
    aic, source = X.aic_estimate_ms(X.CASES[0])
    assert aic == X.RECORDED[X.CASES[0]] and source == "recorded from the aiconfigurator CLI"


def test_a_gpu_without_tables_says_so():
    target = Target.of("h800")
    assert target.tables is None and "H800 SXM5 80GB has no collected tables" in target.tables_note


@needs_tables
def test_a_system_without_tables_or_rows_says_so():
    # the package has a directory for h100_pcie but no table sp_lab reads: modelled, and the note says why
    target = Target.of("h100_pcie")
    assert target.tables is None and "has no nccl table for system 'h100_pcie'" in target.tables_note
    # GB200's collected NCCL rows stop at 4 GPUs: tp 8 is refused naming what there is
    with pytest.raises(ValueError, match=r"all_gather half on 8 GPUs \(the table has 2, 4 GPUs\)"):
        step_latency_rows("llama-3-70b", 8, "gb200", "bfloat16", [16])
    assert (step_latency_rows("llama-3-70b", 4, "gb200", "bfloat16", [16])["tables"] == "collected").all()


def test_cross_check_arithmetic(monkeypatch):
    # AIConfigurator's side fixed at its recorded values, sp_lab's side whatever the model gives: the table's
    # total is the sum of its terms, the ratio is total / AIC, "within" is |ratio - 1| <= 10%.
    monkeypatch.setattr(X, "aic_estimate_ms", lambda case: (X.RECORDED[case], "recorded"))
    table = X.cross_check_table(Target.of("h200_sxm", collected_tables=False))
    for r in table.iter_rows(named=True):
        terms = r["layers_ms"] + r["attention_ms"] + r["embedding_ar_ms"] + r["lm_head_ms"]
        assert r["sp_lab_ms"] == pytest.approx(terms)
        assert r["ratio"] == pytest.approx(r["sp_lab_ms"] / X.RECORDED[X.Case(r["phase"], r["isl"], r["batch"])])
        assert r["within"] == (abs(r["ratio"] - 1) <= 0.10)
    # modelled decode attention: the KV cache's bytes at the HBM rate over a floor, growing with the batch
    decode = table.filter(pl.col("phase") == "decode").sort("batch")
    assert decode["attention_ms"][1] > decode["attention_ms"][0] > 0
    text = X.cross_check_markdown(table)
    assert f"{int(table['within'].sum())} of 4 within 10% of AIConfigurator." in text


def test_step_latency_rows_interface():
    rows = step_latency_rows("llama-3-70b", 8, "h200", "bfloat16", [64, 1, 4096], collected_tables=False)
    assert tuple(rows.columns) == STEP_COLUMNS
    assert rows["num_tokens"].to_list() == [1, 1, 1, 64, 64, 64, 4096, 4096, 4096]
    assert rows["variant"].to_list()[:3] == ["baseline", "sp", "sp+async_tp"]
    assert (rows["source"] == "predicted").all() and (rows["tables"] == "modelled").all()
    assert ((rows["latency_low_us"] <= rows["latency_us"]) & (rows["latency_us"] <= rows["latency_high_us"])).all()
    # the modelled interconnect's uncertainty widens the band of every variant that communicates
    assert (rows["latency_high_us"] > rows["latency_low_us"]).all()
    with pytest.raises(ValueError, match="unknown GPU 'h300'"):
        step_latency_rows("llama-3-70b", 8, "h300", "bfloat16", [1])


@needs_tables
def test_attention_rows_read_back_and_interpolate():
    rows = _parquet("h200_sxm", "generation_attention").filter(
        (pl.col("kernel_source") == "vllm_flash_attn_fa3") & (pl.col("kv_cache_dtype") == "bfloat16")
        & (pl.col("window_size") == 0) & (pl.col("num_heads") == 8) & (pl.col("num_key_value_heads") == 1)
        & (pl.col("head_dim") == 128))
    table = C.AttentionTable.load("h200_sxm", "generation")

    def parquet_us(batch: int, step: int) -> float:
        return 1e3 * rows.filter((pl.col("batch_size") == batch) & (pl.col("step") == step))["latency"].median()

    assert table.latency(8, 1, 128, 64, 127).us == pytest.approx(parquet_us(64, 127))
    mid = table.latency(8, 1, 128, 64, 191)  # between steps 127 and 255
    assert mid.grid == C.INTERPOLATED and parquet_us(64, 127) <= mid.us <= parquet_us(64, 255)


@needs_tables
def test_step_latency_rows_from_collected_tables_name_them():
    rows = step_latency_rows("llama-3-70b", 8, "l40s", "bfloat16", [16])
    assert (rows["tables"] == "collected").all() and (rows["system"] == "l40s").all()
    assert "l40s NCCL" in rows["provenance"][0] and "modelled: the fused kernels' own cost" in rows["provenance"][0]
    assert rows.filter(pl.col("variant") == "baseline")["all_reduce_impl"][0] == C.NCCL  # 8 PCIe GPUs
    with pytest.raises(ValueError, match="no nccl table of version '9.9'"):
        step_latency_rows("llama-3-70b", 8, "l40s", "bfloat16", [16], nccl_version="9.9")
