"""async_tp_min_tokens: gated curve, regret and the recommended threshold (sp_lab.tuning.threshold)."""

from __future__ import annotations

import polars as pl
import pytest

from sp_lab.tuning.threshold import gated_curve, recommend_threshold, regret_table, vllm_reference_threshold

TOKENS = [16, 64, 128, 256, 512, 1024]


def sweep(source="measured", fused=lambda t: 200 + 0.5 * t, repeats=1) -> pl.DataFrame:
    """baseline = 100 + t, fused = 200 + t/2: they cross at t = 200 (fused wins from 256 on)."""
    rows = []
    for t in TOKENS:
        for _ in range(repeats):
            rows += [{"num_tokens": t, "variant": "baseline", "latency_us": 100.0 + t},
                     {"num_tokens": t, "variant": "sp", "latency_us": 150.0 + t},
                     {"num_tokens": t, "variant": "sp+async_tp", "latency_us": fused(t)}]
    return pl.DataFrame(rows).with_columns(source=pl.lit(source), fusion_missing=pl.lit(False))


def test_gated_curve_switches_at_the_threshold():
    curve = gated_curve(sweep(), 256)
    assert curve["variant"].to_list() == ["baseline"] * 3 + ["sp+async_tp"] * 3
    assert curve["latency_us"].to_list() == [116.0, 164.0, 228.0, 328.0, 456.0, 712.0]


def test_regret_table_against_the_faster_variant():
    reg = regret_table(sweep(), 64)  # fuses too early at 64 and 128
    assert reg["best_variant"].to_list() == ["baseline"] * 3 + ["sp+async_tp"] * 3
    assert reg["regret_us"].to_list() == [0.0, 232.0 - 164.0, 264.0 - 228.0, 0.0, 0.0, 0.0]
    assert reg["regret_rel"][1] == pytest.approx(68 / 164)


def test_recommended_threshold_has_zero_regret_at_the_crossover():
    rec = recommend_threshold(sweep(repeats=3))
    assert rec.threshold == 256 and rec.total_regret == 0.0 and not rec.never_fuse
    assert rec.candidates.height == len(TOKENS) + 1
    assert "async_tp_min_tokens=256" in rec.summary()


def test_never_fuse_when_fusion_never_pays():
    rec = recommend_threshold(sweep(fused=lambda t: 300.0 + 2 * t))
    assert rec.never_fuse and rec.threshold == TOKENS[-1] + 1 and rec.total_regret == 0.0


@pytest.mark.filterwarnings("ignore:token counts .* lack one of")
def test_fusion_missing_rows_are_excluded_with_a_warning():
    df = sweep()
    # At 512 the fused program did not fire: its (slow) time must not count as sp+async_tp.
    df = df.with_columns(
        fusion_missing=(pl.col("variant") == "sp+async_tp") & (pl.col("num_tokens") == 512),
        latency_us=pl.when((pl.col("variant") == "sp+async_tp") & (pl.col("num_tokens") == 512))
        .then(10_000.0).otherwise(pl.col("latency_us")),
    )
    with pytest.warns(UserWarning, match="fusion did not fire"):
        rec = recommend_threshold(df)
    with pytest.warns(UserWarning, match="fusion did not fire"):
        table = regret_table(df, 256)
    assert rec.threshold == 256 and 512 not in table["num_tokens"].to_list()


def test_measured_and_simulated_rows_are_never_mixed():
    both = pl.concat([sweep("measured"), sweep("simulated", fused=lambda t: 50.0 + 0.5 * t)])
    with pytest.raises(ValueError, match="mix sources"):
        recommend_threshold(both)
    assert recommend_threshold(both, source="measured").threshold == 256
    assert recommend_threshold(both, source="simulated").threshold == 16  # fusion always wins there
    with pytest.raises(ValueError, match="no rows with source='replayed'"):
        gated_curve(both, 64, source="replayed")


def test_missing_variant_is_an_error():
    with pytest.raises(ValueError, match="no 'sp\\+async_tp' rows"):
        regret_table(sweep().filter(pl.col("variant") != "sp+async_tp"), 64)


def test_vllm_reference_matches_background_numbers():
    # docs/thresholds.md: Llama-70B bf16 on Hopper -> 1024 / 2048 / 4096 tokens at TP 2 / 4 / 8.
    assert [vllm_reference_threshold(8192, 2, tp) for tp in (2, 4, 8)] == [1024, 2048, 4096]
    assert vllm_reference_threshold(4096, 2, 2) is None  # SP off below hidden 8192
    assert vllm_reference_threshold(8192, 2, 8, (10, 0)) == 4 * 4096
