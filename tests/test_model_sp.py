"""Model-level SP gates: tokens per rank from which a fused matmul pays, and the pasteable function."""

import dataclasses

import polars as pl
import pytest

from sp_lab.config import LabConfig
from sp_lab.rules import Leaf, MatmulRule, Split
from sp_lab.tuning.export import describe_file, export_config, function_path
from sp_lab.tuning.model_sp import LAYER_SWEEP, PER_MATMUL, RULE, crossover_per_rank, model_sp_table


def _matmul_rows():
    """Hand-written per-matmul timings at tp 4: qkv's fused form wins from 512 tokens (128 per rank) on, with a
    lucky win at 64 tokens below it; down's never wins; o_proj's from 128 tokens (32 per rank)."""
    fused_wins = {"qkv": {64, 512, 2048}, "o_proj": {128, 512, 2048}, "down": set()}
    shapes = {"qkv": ("ag", 8192, 2560), "o_proj": ("rs", 2048, 8192), "down": ("rs", 7168, 8192)}
    rows = []
    for name, (side, k, n) in shapes.items():
        for m in (16, 64, 128, 512, 2048):
            unfused = 100.0 + m
            rows.append({"name": name, "side": side, "k": k, "n": n, "dtype": "bfloat16", "tp": 4, "m": m,
                         "m_padded": m, "unfused_us": unfused,
                         "fused_us": unfused * (0.8 if m in fused_wins[name] else 1.3),
                         "device": "NVIDIA H200", "torch": "2.11.0", "source": "measured"})
    return pl.DataFrame(rows)


def _sweep_rows(threshold=256, source="measured"):
    """A layer sweep at tp 4 where sp+async_tp is fastest from ``threshold`` tokens on."""
    rows = []
    for t in (16, 64, 256, 1024):
        for variant, base in (("baseline", 100.0), ("sp", 105.0), ("sp+async_tp", 110.0)):
            faster = variant == "sp+async_tp" and t >= threshold
            rows.append({"num_tokens": t, "variant": variant, "latency_us": 80.0 if faster else base,
                         "source": source, "tp": 4, "model": "llama-3-70b", "dtype": "bfloat16", "hidden_size": 8192,
                         "num_layers": 80,
                         "device_name": "NVIDIA H200", "torch_version": "2.11.0", "backend": "nccl"})
    return pl.DataFrame(rows)


def test_crossover_is_where_fusion_keeps_paying():
    rows = _matmul_rows()
    assert crossover_per_rank(rows.filter(pl.col("name") == "qkv")) == 128  # the win at 64 tokens is not a start
    assert crossover_per_rank(rows.filter(pl.col("name") == "o_proj")) == 32
    assert crossover_per_rank(rows.filter(pl.col("name") == "down")) is None


def test_table_function_and_regret_from_per_matmul_rows():
    config = LabConfig(tp_size=4, async_tp_min_tokens=256, max_num_tokens=8192)
    table = model_sp_table(_sweep_rows(), config, matmul_rows=_matmul_rows(), data_hash="h")
    assert [(m.name, m.min_tokens_per_rank, m.basis) for m in table.matmuls] == [
        ("qkv", 128, PER_MATMUL), ("o_proj", 32, PER_MATMUL), ("down", None, PER_MATMUL)]
    assert table.sp_min_tokens_per_rank == 64  # SP + AsyncTP from 256 tokens at tp 4
    # the only regret on the rows is qkv's lucky win at 64 tokens, which the gate leaves unfused:
    # (164 - 0.8 * 164) over the sum of the faster choice per row
    oracle = sum(min(f, u) for f, u in _matmul_rows().select("fused_us", "unfused_us").iter_rows())
    assert table.regret["per_matmul"] == pytest.approx(0.2 * 164 / oracle)
    assert table.regret["layer"] == {"worst": 0.0, "total": 0.0}
    namespace: dict = {}
    exec(table.function_source(), namespace)  # noqa: S102  (the generated function, run as pasted: no imports)
    fn = namespace["min_tokens_per_rank"]
    assert fn(8192, 2560, "bfloat16", 4) == 128 and fn(2048, 8192, "torch.bfloat16", 4) == 32
    assert fn(7168, 8192, "bfloat16", 4) is None and fn(8192, 2560, "bfloat16", 8) is None  # other tp: unmeasured
    assert namespace["SP_MIN_TOKENS_PER_RANK"] == 64
    assert "NVIDIA H200" in namespace["__doc__"] and "torch 2.11.0" in namespace["__doc__"]  # the file's provenance


def test_without_per_matmul_rows_every_matmul_takes_the_layers_gate():
    config = LabConfig(tp_size=4, async_tp_min_tokens=256, max_num_tokens=8192)
    table = model_sp_table(_sweep_rows(), config)
    # llama-3-70b at tp 4: qkv [8192 -> 2560], o_proj [2048 -> 8192], gate_up [8192 -> 14336], down [7168 -> 8192]
    assert [(m.name, m.k, m.n) for m in table.matmuls] == [
        ("qkv", 8192, 2560), ("o_proj", 2048, 8192), ("gate_up", 8192, 14336), ("down", 7168, 8192)]
    assert {(m.min_tokens_per_rank, m.basis) for m in table.matmuls} == {(64, LAYER_SWEEP)}
    assert table.regret["per_matmul"] is None
    never = model_sp_table(_sweep_rows(), LabConfig(tp_size=4, enable_sp=False, enable_async_tp=False))
    assert never.sp_min_tokens_per_rank is None and never.regret["layer"]["worst"] == pytest.approx(0.25)  # (100 - 80) / 80


def test_a_per_matmul_rule_gives_each_shape_its_own_gate():
    # fuse above 1024 total tokens where the output is wide (N > 4096), never where it is narrow
    rule = MatmulRule.from_dict({
        "feature": "n", "threshold": 4096, "left": {"choice": "no_fuse", "confidence": 0.9, "samples": 5},
        "right": {"feature": "m", "threshold": 1024, "left": {"choice": "no_fuse", "confidence": 0.9, "samples": 5},
                  "right": {"choice": "fuse", "confidence": 0.9, "samples": 5}}})
    config = LabConfig(tp_size=4, async_tp_min_tokens=256, max_num_tokens=8192, heuristic=rule)
    table = model_sp_table(_sweep_rows(), config)
    # llama-3-70b at tp 4: qkv N 2560 never; the others fuse from 2048 tokens (the next power of two), 512 per rank
    assert [(m.name, m.min_tokens_per_rank, m.basis) for m in table.matmuls] == [
        ("qkv", None, RULE), ("o_proj", 512, RULE), ("gate_up", 512, RULE), ("down", 512, RULE)]
    early = LabConfig(tp_size=4, async_tp_min_tokens=4096, max_num_tokens=8192, heuristic=rule)
    assert model_sp_table(_sweep_rows(), early).lookup(2048, 8192, "bfloat16", 4) == 1024  # not before SP starts


def test_exported_file_says_what_it_does_and_whether_its_machine_can_answer(tmp_path):
    config = LabConfig(tp_size=4, async_tp_min_tokens=256, max_num_tokens=8192)
    path = export_config(_sweep_rows(), config, tmp_path / "gpu", chosen_in="test", vllm_release="0.31",
                         matmul_rows=_matmul_rows())
    text = describe_file(path)
    assert "vLLM 0.31.0 (chosen): In vLLM 0.31.0 this runs SP + AsyncTP from 256 tokens" in text
    assert '"sp_min_token_num":256' in text and "--tensor-parallel-size 4" in text
    assert "WARNING" not in text and "next: serve with the line above" in text
    assert "SP pays per layer from 64 tokens per rank" in text and function_path(path).name in text
    assert function_path(path).read_text().count("), per-matmul rows") == 3  # the gates came from the matmul rows
    for source, why in (("rehearsal", "no real overlap"), ("simulated", "no GPU measured this policy")):
        text = describe_file(export_config(_sweep_rows(source=source), config, tmp_path / source, chosen_in="test"))
        assert f"WARNING: tuned on {source} rows" in text and why in text and "next: measure on the GPUs" in text


def test_the_fusion_gate_is_where_async_tp_starts_not_where_sp_does():
    # SP from 16 tokens, AsyncTP from 256, tp 4: SP pays per layer from 4 tokens per rank, fusion from 64 (not 4)
    staged = LabConfig(tp_size=4, sp_min_tokens=16, async_tp_min_tokens=256, max_num_tokens=8192)
    table = model_sp_table(_sweep_rows(), staged)
    assert table.sp_min_tokens_per_rank == 4
    assert {(m.min_tokens_per_rank, m.basis) for m in table.matmuls} == {(64, LAYER_SWEEP)}
    # SP without AsyncTP never fuses a matmul: no gate, though SP itself runs from 64 tokens per rank
    sp_only = LabConfig(tp_size=4, enable_async_tp=False, async_tp_min_tokens=256, max_num_tokens=8192)
    table = model_sp_table(_sweep_rows(), sp_only)
    assert table.sp_min_tokens_per_rank == 64
    assert {(m.min_tokens_per_rank, m.basis) for m in table.matmuls} == {(None, LAYER_SWEEP)}
    assert table.lookup(8192, 2560, "bfloat16", 4) is None
    # a rule that fuses everything is floored at the AsyncTP gate, not at SP's start
    fuse_all = dataclasses.replace(staged, heuristic=MatmulRule.always("fuse"))
    assert {(m.min_tokens_per_rank, m.basis) for m in model_sp_table(_sweep_rows(), fuse_all).matmuls} == {(64, RULE)}
    no_async = dataclasses.replace(sp_only, heuristic=MatmulRule.always("fuse"))
    assert {m.min_tokens_per_rank for m in model_sp_table(_sweep_rows(), no_async).matmuls} == {None}


def test_an_fp8_layer_asks_the_rule_about_fp8_matmuls():
    # fuse 1-byte (FP8) operands, never 2-byte ones: the rows' dtype must reach the rule
    by_width = MatmulRule(Split("dtype_bytes", 1.5, Leaf("fuse"), Leaf("no_fuse")))
    config = LabConfig(tp_size=4, async_tp_min_tokens=256, max_num_tokens=8192, heuristic=by_width)
    fp8 = model_sp_table(_sweep_rows().with_columns(dtype=pl.lit("fp8-rowwise")), config)
    bf16 = model_sp_table(_sweep_rows(), config)
    assert {(m.dtype, m.min_tokens_per_rank) for m in fp8.matmuls} == {("fp8-rowwise", 64)}  # from AsyncTP's gate
    assert {(m.dtype, m.min_tokens_per_rank) for m in bf16.matmuls} == {("bfloat16", None)}


def test_matmuls_of_one_shape_share_the_larger_gate():
    """A square layer's qkv (all-gather side) and down (reduce-scatter side) have one (k, n, dtype, tp): the one
    entry they share in the table fuses only where both paid, so the later gate wins, and "never" beats any."""
    shared_shape = {"qkv": ("ag", 4096, 4096, {512, 2048}), "down": ("rs", 4096, 4096, {128, 512, 2048}),
                    "o_proj": ("rs", 2048, 4096, {2048}), "gate_up": ("ag", 2048, 4096, set())}
    rows = []
    for name, (side, k, n, wins) in shared_shape.items():
        for m in (16, 128, 512, 2048):
            rows.append({"name": name, "side": side, "k": k, "n": n, "dtype": "bfloat16", "tp": 4, "m": m,
                         "unfused_us": 100.0 + m, "fused_us": (100.0 + m) * (0.8 if m in wins else 1.3),
                         "device": "NVIDIA H200", "torch": "2.11.0", "source": "measured"})
    config = LabConfig(tp_size=4, async_tp_min_tokens=256, max_num_tokens=8192)
    table = model_sp_table(_sweep_rows(), config, matmul_rows=pl.DataFrame(rows))
    assert [(m.name, m.min_tokens_per_rank) for m in table.matmuls] == [
        ("qkv", 128), ("down", 32), ("o_proj", 512), ("gate_up", None)]
    assert table.lookup(4096, 4096, "bfloat16", 4) == 128  # qkv's, not down's 32 nor the first seen
    assert table.lookup(2048, 4096, "bfloat16", 4) is None  # gate_up never paid: o_proj's 512 does not stand
    namespace: dict = {}
    exec(table.function_source(), namespace)  # noqa: S102  (as pasted into model code)
    assert namespace["min_tokens_per_rank"](4096, 4096, "torch.bfloat16", 4) == 128
    assert namespace["min_tokens_per_rank"](2048, 4096, "bfloat16", 4) is None
    # the other order gives the same answers: the larger gate wins, not the first or the last row
    reordered = model_sp_table(_sweep_rows(), config, matmul_rows=pl.DataFrame(rows[::-1]))
    assert reordered.lookup(4096, 4096, "bfloat16", 4) == 128 and reordered.lookup(2048, 4096, "bfloat16", 4) is None


def _leaf(choice):
    return {"choice": choice, "confidence": 0.9, "samples": 5}


@pytest.mark.parametrize("rule, default, expected", [
    # on the reduction dimension: llama-3-70b at tp 4 has qkv and gate_up at k 8192, down 7168, o_proj 2048
    ({"feature": "k", "threshold": 4096, "left": _leaf("no_fuse"), "right": _leaf("fuse")}, "fuse",
     {"qkv": 64, "o_proj": None, "gate_up": 64, "down": 64}),
    # on the rows per rank (m / tp): from 1024 tokens at tp 4, whatever the shape
    ({"feature": "m_per_rank", "threshold": 128, "left": _leaf("no_fuse"), "right": _leaf("fuse")}, "no_fuse",
     {"qkv": 256, "o_proj": 256, "gate_up": 256, "down": 256}),
    # "unsure" takes the config's default
    ({"feature": "k", "threshold": 4096, "left": _leaf("no_fuse"), "right": _leaf("unsure")}, "fuse",
     {"qkv": 64, "o_proj": None, "gate_up": 64, "down": 64}),
    ({"feature": "k", "threshold": 4096, "left": _leaf("no_fuse"), "right": _leaf("unsure")}, "no_fuse",
     {"qkv": None, "o_proj": None, "gate_up": None, "down": None}),
    # fuse only at the largest count the config serves (8192 = max_num_tokens): the gate is that count per rank
    ({"feature": "m", "threshold": 4096, "left": _leaf("no_fuse"), "right": _leaf("fuse")}, "no_fuse",
     {"qkv": 2048, "o_proj": 2048, "gate_up": 2048, "down": 2048}),
])
def test_a_rules_gate_reads_every_feature_of_the_matmul_and_its_unsure_answers(rule, default, expected):
    config = LabConfig(tp_size=4, async_tp_min_tokens=256, max_num_tokens=8192, heuristic=MatmulRule.from_dict(rule),
                       heuristic_default=default)
    table = model_sp_table(_sweep_rows(), config)
    assert {m.name: m.min_tokens_per_rank for m in table.matmuls} == expected
    assert {m.basis for m in table.matmuls} == {RULE}
