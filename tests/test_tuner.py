"""The tuner's state (no browser) and its widget wiring (ipywidgets objects, no front end)."""

from __future__ import annotations

import polars as pl
import pytest

from sp_lab.config import LabConfig, load_tuned_config
from sp_lab.widgets.tuner import TunerState, simulated_rows, tune

TOKENS = [1, 8, 64, 512]
# baseline is flat-ish, sp+async_tp pays a fixed cost and wins from 512 tokens on
LATENCY = {"baseline": {1: 100.0, 8: 110.0, 64: 200.0, 512: 1000.0},
           "sp+async_tp": {1: 300.0, 8: 310.0, 64: 250.0, 512: 600.0}}


def _row(variant: str, t: int, **extra) -> dict:
    us = LATENCY[variant][t]
    return {"source": "measured", "variant": variant, "num_tokens": t, "latency_us": us, "p10_us": us * 0.9,
            "p90_us": us * 1.1, "fusion_fired": variant != "baseline", "fusion_missing": False,
            "device_name": "cpu: test", "tp": 2, "model": "toy", "hidden_size": 64, "num_layers": 2,
            "torch_version": "2.13.0", "boundary": "sharded", "dtype": "float32", "row_id": f"{variant}-{t}",
            **extra}


@pytest.fixture
def rows() -> pl.DataFrame:
    return pl.DataFrame([_row(v, t) for v in LATENCY for t in TOKENS])


def test_gated_curve_and_regret_follow_the_threshold(rows):
    state = TunerState(tp=2)
    state.set_rows(rows)
    state.threshold = 1
    assert state.gated()["latency_us"].to_list() == [300.0, 310.0, 250.0, 600.0]
    state.threshold = 512
    assert state.gated()["latency_us"].to_list() == [100.0, 110.0, 200.0, 600.0]
    assert state.regret()["regret_us"].sum() == 0.0
    state.threshold = 64
    assert state.regret().filter(pl.col("num_tokens") == 64)["regret_us"].item() == pytest.approx(50.0)


def test_recommendation_is_the_least_regret_threshold(rows):
    state = TunerState(tp=2)
    state.set_rows(rows)
    assert state.recommendation().threshold == 512


def test_rows_arrive_one_by_one_and_recommendation_waits_for_both_variants():
    state = TunerState(tp=2)
    state.add_row(_row("baseline", 8))
    assert not state.can_recommend() and state.gated().height == 0
    state.add_row(_row("sp+async_tp", 8))
    assert state.can_recommend() and state.done == 2


def test_mixed_sources_are_refused(rows):
    state = TunerState(tp=2)
    with pytest.raises(ValueError, match="mix sources"):
        state.set_rows(pl.concat([rows, rows.with_columns(source=pl.lit("simulated"))]))


def test_export_round_trips_the_threshold(rows, tmp_path):
    state = TunerState(tp=2, config=LabConfig(tp_size=2))
    state.set_rows(rows)
    state.threshold = 64
    path = state.export(tmp_path)
    config, provenance = load_tuned_config(path)
    assert config.async_tp_min_tokens == 64 and config.enable_sp and config.enable_async_tp
    assert provenance["recommended_async_tp_min_tokens"] == 512
    assert provenance["data_hash"] == state.data_hash()


def test_export_without_rows_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="run a sweep or replay"):
        TunerState(tp=2).export(tmp_path)


def test_live_sweep_needs_a_store():
    with pytest.raises(ValueError, match="store_dir"):
        TunerState(tp=2).run_sweep()


def test_simulated_replay_is_labelled_and_has_the_plot_columns():
    df = simulated_rows("llama-3-70b", 8, [1, 512, 4096])
    assert set(df["source"]) == {"simulated"}
    from sp_lab.viz.latency import SWEEP_COLUMNS

    assert not set(SWEEP_COLUMNS) - set(df.columns)


def test_widget_slider_redraws_the_gated_trace_and_replays(rows, tmp_path):
    tuner = tune("toy", tp=2, token_counts=TOKENS, store_dir=None, export_dir=tmp_path, replay=rows)
    gated = next(t for t in tuner.figure.data if t.meta == "gated")
    assert tuner.slider.value == 512 and list(gated.y) == [100.0, 110.0, 200.0, 600.0]
    tuner.slider.value = 1  # what dragging the slider does
    gated = next(t for t in tuner.figure.data if t.meta == "gated")
    assert list(gated.y) == [300.0, 310.0, 250.0, 600.0]
    assert "recommended" in tuner.regret_html.value
    assert tuner.export() is not None and "exported" in tuner.status.value
    latency = [t for t in tuner.figure.data if str(t.meta).startswith("latency:")]
    assert {t.name for t in latency} == {"baseline", "sp+async_tp"}


def test_half_measured_token_counts_are_left_out_silently(rows, recwarn):
    state = TunerState(tp=2)
    state.set_rows(rows.filter(~((pl.col("variant") == "sp+async_tp") & (pl.col("num_tokens") == 512))))
    assert state.gated()["num_tokens"].to_list() == [1, 8, 64]
    assert not [w for w in recwarn if "lack one of" in str(w.message)]


def test_never_fuse_recommendation_exports_sp_off(tmp_path):
    slow = pl.DataFrame([_row(v, t) for v in LATENCY for t in TOKENS[:3]])  # fusion never wins below 512
    state = TunerState(tp=2)
    state.set_rows(slow)
    rec = state.recommendation()
    assert rec.never_fuse
    state.threshold = rec.threshold
    config, _ = load_tuned_config(state.export(tmp_path))
    assert not config.enable_sp and not config.enable_async_tp
