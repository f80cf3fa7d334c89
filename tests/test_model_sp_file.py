"""The model-level SP table where test_model_sp's fixtures do not reach: tp 1 and an odd gate at tp 2, per-matmul
rows with missing timings or padded token counts, a model sp_lab cannot read, and what the generated file's
docstring and the table's provenance say."""

import polars as pl
import pytest

from sp_lab.config import LabConfig
from sp_lab.tuning.model_sp import LAYER_SWEEP, PER_MATMUL, crossover_per_rank, model_sp_table

CONFIG = LabConfig(tp_size=4, async_tp_min_tokens=256, max_num_tokens=8192)


def _sweep_rows(tp=4, model="llama-3-70b", threshold=256):
    """A layer sweep where sp+async_tp is fastest from ``threshold`` tokens on (the rest: baseline)."""
    rows = []
    for t in (16, 64, 256, 1024):
        for variant, base in (("baseline", 100.0), ("sp", 105.0), ("sp+async_tp", 110.0)):
            faster = variant == "sp+async_tp" and t >= threshold
            rows.append({"num_tokens": t, "variant": variant, "latency_us": 80.0 if faster else base,
                         "source": "measured", "tp": tp, "model": model, "dtype": "bfloat16", "hidden_size": 8192,
                         "num_layers": 80, "device_name": "NVIDIA H200", "torch_version": "2.11.0", "backend": "nccl"})
    return pl.DataFrame(rows)


def _matmul(m, fused, unfused, **extra):
    return {"name": "qkv", "side": "ag", "k": 8192, "n": 2560, "dtype": "bfloat16", "tp": 4, "m": m,
            "fused_us": fused, "unfused_us": unfused, "device": "NVIDIA B200", "torch": "2.12.0", "source": "measured",
            **extra}


def test_one_rank_has_no_sp_and_no_fusion_gate():
    table = model_sp_table(_sweep_rows(tp=1), LabConfig(tp_size=1, async_tp_min_tokens=256, max_num_tokens=8192))
    assert table.sp_min_tokens_per_rank is None and table.sp_min_tokens is None
    assert [(m.name, m.min_tokens_per_rank, m.basis) for m in table.matmuls] == [
        ("qkv", None, LAYER_SWEEP), ("o_proj", None, LAYER_SWEEP), ("gate_up", None, LAYER_SWEEP),
        ("down", None, LAYER_SWEEP)]


def test_a_gate_tp_does_not_divide_rounds_up_to_whole_shard_rows():
    """At tp 2, SP from 15 tokens and AsyncTP from 255: a rank holds ceil(15 / 2) = 8 and ceil(255 / 2) = 128 rows
    there, and the whole-batch gate is the shard rows times tp (16: 15 tokens already give 8 rows a rank)."""
    config = LabConfig(tp_size=2, sp_min_tokens=15, async_tp_min_tokens=255, max_num_tokens=8192)
    table = model_sp_table(_sweep_rows(tp=2), config)
    assert (table.sp_min_tokens_per_rank, table.sp_min_tokens) == (8, 16)
    assert {m.min_tokens_per_rank for m in table.matmuls} == {128}
    assert table.to_dict()["sp_min_tokens"] == 16 and table.to_dict()["sp_min_tokens_per_rank"] == 8


def test_two_counts_on_the_same_shard_rows_that_disagree_give_one_answer_in_either_order():
    """m = 125 and 128 both run 32 rows a rank at tp 4; fused wins at one and loses at the other. A loss there is
    not outweighed by the win, whichever row comes first: the gate starts at the next count that wins."""
    rows = [_matmul(125, 90.0, 100.0), _matmul(128, 110.0, 100.0), _matmul(256, 150.0, 200.0),
            _matmul(1024, 500.0, 900.0)]
    assert crossover_per_rank(pl.DataFrame(rows)) == crossover_per_rank(pl.DataFrame(rows[::-1])) == 64


def test_per_matmul_rows_without_a_timing_are_left_out_and_padded_counts_are_what_ran():
    """A row whose fused (or unfused) time is missing says nothing: neither a loss that would move the gate nor a
    term of the regret. Where rows were padded (``m_padded``), the padded count is what ran on a rank."""
    rows = pl.DataFrame([
        _matmul(100, 130.0, 100.0, m_padded=128),  # 32 rows a rank as run, not ceil(100 / 4) = 25
        _matmul(200, 160.0, 200.0, m_padded=256),  # wins from here: 64 rows a rank
        _matmul(900, None, 900.0, m_padded=1024),  # not measured fused: no loss here
        _matmul(2000, 1600.0, None, m_padded=2048),
        _matmul(4000, 3200.0, 4000.0, m_padded=4096),
    ])
    assert crossover_per_rank(rows) == 64
    table = model_sp_table(_sweep_rows(), CONFIG, matmul_rows=rows)
    assert [(m.name, m.min_tokens_per_rank, m.basis) for m in table.matmuls] == [("qkv", 64, PER_MATMUL)]
    assert table.regret["per_matmul"] == 0.0  # the gate picks the faster form at every row that has both times
    lost = pl.DataFrame([_matmul(100, 90.0, 100.0, m_padded=128), _matmul(200, 260.0, 200.0, m_padded=256),
                         _matmul(900, None, 900.0, m_padded=1024), _matmul(4000, 3200.0, 4000.0, m_padded=4096)])
    # fused from 1024 rows a rank: the lucky win at 32 stays unfused, 10 us lost over 90 + 200 + 3200 of the faster
    # forms (the row without a fused time neither adds nor ends the sum)
    assert model_sp_table(_sweep_rows(), CONFIG, matmul_rows=lost).regret["per_matmul"] == pytest.approx(10 / 3490)


def test_no_per_matmul_rows_means_the_layer_gate_and_a_model_not_read_means_no_matmuls():
    empty = pl.DataFrame(schema=pl.DataFrame([_matmul(16, 1.0, 1.0)]).schema)
    table = model_sp_table(_sweep_rows(), CONFIG, matmul_rows=empty)
    assert {(m.min_tokens_per_rank, m.basis) for m in table.matmuls} == {(64, LAYER_SWEEP)}
    assert {(m.dtype, m.tp) for m in table.matmuls} == {("bfloat16", 4)}
    assert table.lookup(8192, 2560, "bf16", 4) == 64  # qkv of llama-3-70b at tp 4, the layer's gate
    assert table.regret["per_matmul"] is None and "matmul_rows" not in table.provenance
    unknown = model_sp_table(_sweep_rows(model="no-such-model"), CONFIG)
    assert unknown.matmuls == () and unknown.sp_min_tokens_per_rank == 64
    assert unknown.lookup(8192, 2560, "bf16", 4) is None  # a shape the table does not hold: not measured
    ns: dict = {}
    exec(unknown.function_source(), ns)  # noqa: S102  (the file as pasted: every shape unmeasured)
    assert ns["min_tokens_per_rank"](8192, 2560, "bf16", 4) is None and ns["SP_MIN_TOKENS"] == 256
    # tp 3 divides none of llama-3-70b's heads: its matmuls cannot be placed, the layer gates still can
    odd = model_sp_table(_sweep_rows(tp=3), LabConfig(tp_size=3, async_tp_min_tokens=256, max_num_tokens=8192))
    assert odd.matmuls == () and odd.sp_min_tokens_per_rank == 86


def test_the_tables_provenance_names_both_sets_of_rows():
    rows = pl.DataFrame([_matmul(m, 0.8 * m, float(m), m_padded=m) for m in (256, 1024)])
    table = model_sp_table(_sweep_rows(), CONFIG, matmul_rows=rows, data_hash="h")
    assert table.provenance == {"device": "NVIDIA H200", "torch": "2.11.0", "source": "measured", "backend": "nccl",
                                "model": "llama-3-70b", "tp": 4, "dtype": "bfloat16", "data_hash": "h",
                                "matmul_rows": {"device": "NVIDIA B200", "torch": "2.12.0", "source": "measured",
                                                "rows": 2}}
    assert table.to_dict() == {"matmuls": [{"name": "qkv", "side": "ag", "k": 8192, "n": 2560, "dtype": "bfloat16",
                                            "tp": 4, "min_tokens_per_rank": 64, "basis": PER_MATMUL}],
                               "sp_min_tokens_per_rank": 64, "sp_min_tokens": 256, "regret": table.regret,
                               "provenance": table.provenance}


def test_the_generated_files_docstring_says_where_the_gates_come_from_and_what_they_cost():
    rows = pl.DataFrame([_matmul(256, 90.0, 100.0, m_padded=256), _matmul(512, 120.0, 100.0, m_padded=512),
                         _matmul(1024, 160.0, 200.0, m_padded=1024)])
    # the sweep's sp+async_tp was 20 us faster at 256 tokens, where this config runs baseline: 25% regret there
    late = LabConfig(tp_size=4, async_tp_min_tokens=1024, max_num_tokens=8192)
    table = model_sp_table(_sweep_rows(), late, matmul_rows=rows, data_hash="abc")
    ns: dict = {}
    exec(table.function_source(), ns)  # noqa: S102
    doc = " ".join(ns["__doc__"].split())
    assert ("From sp_lab's measured rows on NVIDIA H200 (torch 2.11.0, model llama-3-70b, tp 4, bfloat16, rows abc). "
            "SP itself paid per layer from SP_MIN_TOKENS tokens of the whole batch (SP_MIN_TOKENS_PER_RANK per rank; "
            "worst regret 25.0%, total 25.0% on the sweep rows). Regret on the per-matmul rows: 2.86%.") in doc
    # 10 us lost at 256 tokens (the lucky win below a loss stays unfused) over 90 + 100 + 160 of the faster forms
    assert table.regret["per_matmul"] == pytest.approx(10 / 350)
    assert (ns["SP_MIN_TOKENS_PER_RANK"], ns["SP_MIN_TOKENS"]) == (256, 1024)
    assert ns["min_tokens_per_rank"](8192, 2560, "bf16", 4) == 256 and ns["min_tokens"](8192, 2560, "bf16", 4) == 1024
    # without per-matmul rows the file says nothing of them
    layer_only = model_sp_table(_sweep_rows(), late)
    layer_doc = " ".join(layer_only.function_source().split('"""')[1].split())
    assert "worst regret 25.0%, total 25.0% on the sweep rows). Two units:" in layer_doc


def test_per_matmul_rows_without_a_single_pair_of_timings_give_no_gate_and_no_regret():
    rows = pl.DataFrame([_matmul(256, None, 100.0, m_padded=256), _matmul(1024, None, 300.0, m_padded=1024)])
    table = model_sp_table(_sweep_rows(), CONFIG, matmul_rows=rows)
    assert [(m.name, m.min_tokens_per_rank) for m in table.matmuls] == [("qkv", None)]
    assert table.regret["per_matmul"] == 0.0  # nothing compared, nothing lost (not a division by zero)


def test_a_tie_is_not_a_win_for_the_fused_form():
    """Fusing where it is only as fast as the collective and the matmul apart gains nothing: a tie is a loss."""
    rows = pl.DataFrame([_matmul(256, 80.0, 100.0, m_padded=256), _matmul(1024, 300.0, 300.0, m_padded=1024)])
    assert crossover_per_rank(rows) is None


def test_no_sweep_rows_is_refused_with_what_to_run():
    with pytest.raises(ValueError, match=r"^no sweep rows: run a sweep first \(python -m sp_lab run\)$"):
        model_sp_table(_sweep_rows().clear(), CONFIG)


def test_the_table_does_not_repeat_the_warning_about_rows_whose_fusion_did_not_fire():
    """The tuner's regret already warned about such rows (left out of the medians); the model-level table, built from
    the same rows at export, leaves them out without a second warning."""
    import warnings

    rows = _sweep_rows().with_columns(fusion_missing=pl.lit(False))
    rows = pl.concat([rows, rows.head(1).with_columns(fusion_missing=pl.lit(True), latency_us=pl.lit(1.0))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = model_sp_table(rows, CONFIG)
    assert table.regret["layer"] == {"worst": 0.0, "total": 0.0}  # the 1 us row that ran another program left out


def test_a_rules_gates_keep_each_matmuls_side():
    """The side (all-gather before, reduce-scatter after) names the fused kernel a gate is for; vLLM's fused
    all-gather + matmul takes qkv's all-gather gate, so a rule's gates must keep it as the layer's do."""
    from sp_lab.rules import MatmulRule

    ruled = LabConfig(tp_size=4, async_tp_min_tokens=256, max_num_tokens=8192, heuristic=MatmulRule.always("fuse"))
    sides = [(m.name, m.side) for m in model_sp_table(_sweep_rows(), ruled).matmuls]
    assert sides == [("qkv", "ag"), ("o_proj", "rs"), ("gate_up", "ag"), ("down", "rs")]
    assert sides == [(m.name, m.side) for m in model_sp_table(_sweep_rows(), CONFIG).matmuls]
