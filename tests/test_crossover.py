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
