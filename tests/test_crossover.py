"""The predicted crossover's band (``sp_lab.tuning.predict.crossover.predicted_crossover``) on synthetic predictions.

The performance model is replaced by latencies written here: each input set (the nominal target and every
perturbed one) names the token count from which sp+async_tp beats baseline, or none. What is under test is only
how the band is drawn from those crossovers, above all that an input set that never crosses leaves the band open
above (the crossover may lie past the grid) instead of being ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl
import pytest

from sp_lab.tuning.predict import crossover

GRID = (16, 64, 256, 1024, 4096)


@dataclass(frozen=True)
class Inputs:
    """A stand-in for the model's target: where its predictions cross (``None``: nowhere on the grid)."""

    crosses_at: int | None


def _rows(inputs: Inputs, grid) -> pl.DataFrame:
    fused = [50.0 if inputs.crosses_at is not None and t >= inputs.crosses_at else 150.0 for t in grid]
    return pl.DataFrame({"num_tokens": [*grid, *grid], "variant": ["baseline"] * len(grid) + ["sp+async_tp"] * len(grid),
                         "latency_us": [100.0] * len(grid) + fused})


@pytest.fixture
def band(monkeypatch):
    """``band(nominal, perturbed)``: predicted_crossover over synthetic predictions."""
    def fake_predict(spec, tp, grid, target, **_):
        assert isinstance(target, Inputs), target
        return _rows(target, grid)

    def run(nominal: int | None, perturbed: list[int | None]) -> crossover.Crossover:
        monkeypatch.setattr(crossover, "predict_layers", fake_predict)
        monkeypatch.setattr(crossover, "perturbed_targets", lambda target: [Inputs(x) for x in perturbed])
        return crossover.predicted_crossover("any model", 2, Inputs(nominal), grid=GRID)
    return run


def test_the_band_spans_every_perturbed_crossover(band):
    got = band(256, [64, 1024, 256, 256])
    assert (got.tokens, got.low, got.high, got.grid_max) == (256, 64, 1024, 4096)
    assert got.describe() == "256 tokens (band 64-1024)"


def test_a_perturbation_that_never_crosses_leaves_the_band_open_above(band):
    got = band(256, [64, 1024, None, 256])
    assert (got.tokens, got.low, got.high) == (256, 64, None)
    assert got.describe() == "256 tokens (band 64->4096)"


def test_a_nominal_model_that_never_crosses_still_shows_where_perturbations_do(band):
    got = band(None, [1024, None])
    assert (got.tokens, got.low, got.high) == (None, 1024, None)
    assert got.describe() == ">4096 tokens (band 1024->4096)"
    nowhere = band(None, [None, None])
    assert (nowhere.tokens, nowhere.low, nowhere.high) == (None, None, None)
    assert nowhere.describe() == "none up to 4096 tokens"


def test_each_uncertain_input_moves_one_step_and_nothing_else():
    """Bandwidths (NCCL's and the copy engine's together) x0.8 and x1.25, alphas x0.5 and x2, contention off and
    doubled: six targets, each differing from the nominal one in that input only."""
    import dataclasses

    from sp_lab.tuning.predict.layer import Target

    target = Target.of("h100", collected_tables=False, contention_scale=1.5)
    ic = target.interconnect
    moved = crossover.perturbed_targets(target)
    steps = [(t.interconnect.busbw_gbps / ic.busbw_gbps, t.interconnect.copy_gbps / ic.copy_gbps,
              t.interconnect.alpha_us / ic.alpha_us, t.interconnect.copy_alpha_us / ic.copy_alpha_us,
              t.contention_scale) for t in moved]
    assert [x for step in steps for x in step] == pytest.approx([
        0.8, 0.8, 1, 1, 1.5,
        1.25, 1.25, 1, 1, 1.5,
        1, 1, 0.5, 0.5, 1.5,
        1, 1, 2, 2, 1.5,
        1, 1, 1, 1, 0.0,
        1, 1, 1, 1, 3.0])
    for t in moved:  # the GPU, dtype, timing, tables and the interconnect's name and sources stay
        same = dataclasses.replace(t.interconnect, busbw_gbps=ic.busbw_gbps, copy_gbps=ic.copy_gbps,
                                   alpha_us=ic.alpha_us, copy_alpha_us=ic.copy_alpha_us)
        assert t.replace(interconnect=same, contention_scale=1.5) == target


def test_the_band_of_a_named_gpu_moves_each_of_its_inputs(monkeypatch):
    """A stand-in model of the named GPU whose crossover moves with the interconnect's bandwidth (256 tokens
    nominal, 1024 at x0.8, 64 at x1.25) and never comes with contention doubled: the band is 64 to open above."""
    from sp_lab.tuning.predict.layer import Target

    nominal = Target.of("h100", collected_tables=False).interconnect.busbw_gbps

    def fake_predict(spec, tp, grid, target, **_):
        assert isinstance(target, Target) and target.gpu.name == "h100", target
        at = {0.8: 1024, 1.0: 256, 1.25: 64}[round(target.interconnect.busbw_gbps / nominal, 3)]
        return _rows(Inputs(None if target.contention_scale > 1 else at), grid)

    monkeypatch.setattr(crossover, "predict_layers", fake_predict)
    got = crossover.predicted_crossover("any model", 2, "h100", grid=GRID)
    assert (got.variant, got.against, got.tokens, got.low, got.high) == ("sp+async_tp", "baseline", 256, 64, None)


def test_the_band_reads_the_matmul_table_it_is_given(monkeypatch):
    """A stand-in model whose crossover is set by the matmul table it reads (none given: the target's)."""
    def fake_predict(spec, tp, grid, target, *, table=None, **_):
        return _rows(table if table is not None else target, grid)

    monkeypatch.setattr(crossover, "predict_layers", fake_predict)
    monkeypatch.setattr(crossover, "perturbed_targets", lambda target: [target, target])
    got = crossover.predicted_crossover("any model", 2, Inputs(256), grid=GRID, table=Inputs(1024))
    assert (got.tokens, got.low, got.high) == (1024, 1024, 1024)
    assert crossover.predicted_crossover("any model", 2, Inputs(256), grid=GRID).tokens == 256


def _two_variants(fused: list[float], sp: list[float]) -> pl.DataFrame:
    n = [1, 2, 4, 8]
    return pl.DataFrame({"num_tokens": n * 3 + [16], "variant": ["baseline"] * 4 + ["sp+async_tp"] * 4 + ["sp"] * 4
                         + ["tuned"], "latency_us": [10.0] * 4 + fused + sp + [1.0]})


def test_the_crossover_compares_the_two_variants_asked_for_and_no_other():
    # sp+async_tp wins from 4, sp from 2; a tuned row at 16 tokens, where the others were not measured, is not looked at
    rows = _two_variants([20.0, 20.0, 9.0, 9.0], [20.0, 9.0, 9.0, 9.0])
    assert crossover.crossover_tokens(rows) == crossover.crossover_tokens(rows, "sp+async_tp", "baseline") == 4
    assert crossover.crossover_tokens(rows, "sp") == 2
    assert crossover.crossover_tokens(rows, "baseline", against="sp+async_tp") is None  # it wins only below 4
    assert crossover.crossover_tokens(rows, "sp+async_tp", against="sp") is None


def test_a_count_only_one_variant_was_timed_at_is_not_read_as_a_loss():
    # a sweep still running: sp+async_tp timed at 32 tokens, baseline not yet; the crossover stays at 4
    rows = _two_variants([20.0, 20.0, 9.0, 9.0], [20.0, 9.0, 9.0, 9.0])
    more = pl.concat([rows, rows.filter((pl.col("variant") == "sp+async_tp") & (pl.col("num_tokens") == 8))
                      .with_columns(num_tokens=pl.lit(32, rows.schema["num_tokens"]))])
    assert crossover.crossover_tokens(more) == crossover.crossover_tokens(rows) == 4


def test_the_crossover_names_the_variants_it_needs():
    rows = _two_variants([9.0] * 4, [9.0] * 4).filter(pl.col("variant") != "sp+async_tp")
    with pytest.raises(ValueError, match=r"rows need both 'sp\+async_tp' and 'baseline' rows; have \['baseline', 'sp', 'tuned'\]"):
        crossover.crossover_tokens(rows)
    with pytest.raises(ValueError, match=r"rows need both 'sp' and 'sp\+async_tp' rows"):
        crossover.crossover_tokens(rows, "sp", against="sp+async_tp")


def test_the_grid_has_four_counts_per_doubling_from_1_to_65536():
    assert crossover.GRID[:8] == (1, 2, 3, 4, 5, 6, 7, 8) and crossover.GRID[-5:] == (32768, 38968, 46341, 55109, 65536)
    assert len(crossover.GRID) == len(set(crossover.GRID)) and list(crossover.GRID) == sorted(crossover.GRID)


def test_the_band_predicts_the_model_tp_and_variants_asked_for(monkeypatch):
    """A stand-in model whose crossover depends on the model, tp and the pair compared: sp over sp+async_tp at
    tp 4 of model "b" crosses at 1024, anything else at 64 -- every input set must be predicted for the same."""
    def fake_predict(spec, tp, grid, target, **_):
        at = 1024 if (spec, tp) == ("b", 4) else 64
        return _rows(Inputs(at), grid).with_columns(variant=pl.col("variant").replace({"baseline": "sp+async_tp",
                                                                                      "sp+async_tp": "sp"}))

    monkeypatch.setattr(crossover, "predict_layers", fake_predict)
    monkeypatch.setattr(crossover, "perturbed_targets", lambda target: [target, target])
    got = crossover.predicted_crossover("b", 4, Inputs(None), variant="sp", against="sp+async_tp", grid=GRID)
    assert (got.variant, got.against, got.tokens, got.low, got.high) == ("sp", "sp+async_tp", 1024, 1024, 1024)


def test_the_crossover_reads_rows_with_every_column_a_prediction_has():
    """Predicted rows carry per-variant terms (``matmul_us``, ``comm_us``, ...) beside the latency: the comparison
    is of ``latency_us`` at each token count, whatever else the rows hold."""
    rows = _two_variants([20.0, 20.0, 9.0, 9.0], [20.0, 9.0, 9.0, 9.0]).with_columns(
        matmul_us=pl.col("latency_us") * 0.7, comm_us=pl.col("latency_us") * 0.3, model=pl.lit("m"))
    assert crossover.crossover_tokens(rows) == 4
    assert crossover.crossover_tokens(rows, "sp") == 2
