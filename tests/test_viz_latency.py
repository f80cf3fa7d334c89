"""Tests for sp_lab.viz.latency: assertions on series / thresholds / regret, smoke renders."""

from __future__ import annotations

import math

import polars as pl
import pytest

go = pytest.importorskip("plotly.graph_objects", reason="plotly is optional on GPU machines")

from sp_lab.viz import latency

TOKENS = (1, 8, 64, 128, 512, 2048, 8192)
# Made-up latencies with the published shape: fusion loses at small token counts, wins at large ones.
FACTOR = {"baseline": lambda n: 1.0, "sp": lambda n: 0.97, "sp+async_tp": lambda n: 1.5 if n < 512 else 0.9,
          "tuned": lambda n: 0.97 if n < 512 else 0.92}


def _row(n: int, variant: str, **overrides) -> dict:
    base = (100.0 + 0.1 * n) * FACTOR[variant](n)
    row = {"num_tokens": n, "variant": variant, "latency_us": base, "p10_us": 0.95 * base, "p90_us": 1.1 * base,
           "fusion_fired": variant in ("sp+async_tp", "tuned"), "fusion_missing": False, "source": "measured",
           "device_name": "cpu", "tp": 2, "model": "toy", "torch_version": "2.13.0+cpu", "boundary": "sharded",
           "dtype": "float32"}
    row.update(overrides)
    return row


@pytest.fixture
def sweep() -> pl.DataFrame:
    return pl.DataFrame([_row(n, v) for n in TOKENS for v in FACTOR])


def _series(data: latency.LatencyData) -> dict[str, latency.LatencySeries]:
    return {s.label: s for s in data.series}


def test_variants_become_series_in_order(sweep):
    data = latency.latency_data(sweep)
    assert [s.label for s in data.series] == ["baseline", "sp", "sp+async_tp", "tuned"]
    assert all(s.points["num_tokens"].to_list() == list(TOKENS) for s in data.series)
    assert all(s.dash == "solid" and not s.hollow for s in data.series)


def test_fusion_missing_rows_never_drawn_as_the_variant(sweep):
    # A run whose fusion did not fire is an "sp" run in disguise, and suspiciously fast here.
    rows = pl.concat([sweep, pl.DataFrame([_row(4096, "sp+async_tp", latency_us=1.0, p10_us=1.0, p90_us=1.0,
                                                fusion_fired=False, fusion_missing=True)])])
    data = latency.latency_data(rows, async_tp_min_tokens=128)
    series = _series(data)
    missing = series["sp+async_tp (fusion did not fire)"]
    assert missing.hollow and missing.points["num_tokens"].to_list() == [4096]
    assert 4096 not in series["sp+async_tp"].points["num_tokens"].to_list()
    assert not data.regret.filter(pl.col("best_us") == 1.0).height  # never "best" either
    fig = latency.build_latency_figure(data)
    trace = next(t for t in fig.data if t.name == "sp+async_tp (fusion did not fire)")
    assert trace.marker.symbol == "circle-open"


def test_simulated_and_replayed_rows_are_labelled(sweep):
    rows = pl.concat([
        sweep,
        pl.DataFrame([_row(n, "sp+async_tp", source="simulated") for n in TOKENS]),
        pl.DataFrame([_row(n, "sp", source="recorded", device_name="NVIDIA H200", tp=8,
                           torch_version="2.9.0+cu128") for n in TOKENS]),
    ])
    series = _series(latency.latency_data(rows))
    assert series["sp+async_tp (simulated)"].dash == "dash"
    assert "sp [NVIDIA H200, tp8, torch 2.9.0+cu128]" in series
    # Live rows agree on device/tp/torch among themselves, so their labels stay short.
    assert "sp" in series and "baseline" in series
    fig = latency.build_latency_figure(latency.latency_data(rows))
    assert next(t for t in fig.data if t.name == "sp+async_tp (simulated)").line.dash == "dash"


def test_provenance_that_varies_is_appended(sweep):
    rows = pl.concat([sweep, sweep.with_columns(model=pl.lit("llama-3-8b"))])
    labels = [s.label for s in latency.latency_data(rows).series]
    assert "sp · model=llama-3-8b" in labels and "sp · model=toy" in labels


def test_duplicate_rows_pool_by_median(sweep):
    rows = pl.concat([sweep, sweep.with_columns(pl.col("latency_us") * 3), sweep.with_columns(pl.col("latency_us") * 2)])
    sp = _series(latency.latency_data(rows))["sp"].points
    assert sp["n"].to_list() == [3] * len(TOKENS)
    assert sp["latency_us"].to_list() == pytest.approx([2 * v for v in _series(latency.latency_data(sweep))["sp"]
                                                        .points["latency_us"].to_list()])


def test_thresholds_and_regret(sweep):
    data = latency.latency_data(sweep, async_tp_min_tokens=128, vllm_min_tokens=1024)
    assert [(t.name, t.num_tokens) for t in data.thresholds] == [("async_tp_min_tokens", 128), ("vllm", 1024)]
    gated = data.regret.filter(pl.col("curve") == "gated")
    chosen = dict(zip(gated["num_tokens"].to_list(), gated["chosen_variant"].to_list()))
    assert chosen == {n: ("sp" if n < 128 else "sp+async_tp") for n in TOKENS}
    by_n = {r["num_tokens"]: r for r in gated.iter_rows(named=True)}
    # At 128 tokens the gate already fuses but fusion still loses: 1.5 / 0.97 - 1.
    assert by_n[128]["best_variant"] == "sp" and by_n[128]["regret"] == pytest.approx(1.5 / 0.97 - 1)
    assert by_n[8192]["regret"] == 0.0 and by_n[1]["regret"] == 0.0
    tuned = data.regret.filter(pl.col("curve") == "tuned")
    assert tuned.height == len(TOKENS) and tuned["regret"].max() == pytest.approx(0.92 / 0.9 - 1)

    fig = latency.build_latency_figure(data)
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis2.type == "log"
    assert sorted(s.x0 for s in fig.layout.shapes) == [128, 1024]
    labels = {a.text: a.x for a in fig.layout.annotations if a.xref == "x"}
    assert labels == pytest.approx({"async_tp_min_tokens=128": math.log10(128),
                                    "vLLM sp_min_token_num=1024": math.log10(1024)})
    assert {t.name for t in fig.data if t.yaxis == "y2"} == {"regret: gated", "regret: tuned"}


def test_no_threshold_means_no_gated_curve(sweep):
    data = latency.latency_data(sweep)
    assert set(data.regret["curve"].to_list()) == {"tuned"} and not data.thresholds


def test_live_widget_updates_in_place(sweep):
    first = sweep.filter(pl.col("num_tokens") <= 64)
    fig = latency.plot_latency(first, async_tp_min_tokens=128, widget=True)
    assert isinstance(fig, go.FigureWidget)
    sp_trace = next(t for t in fig.data if t.name == "sp")
    n_traces = len(fig.data)
    assert len(sp_trace.x) == 3
    more = pl.concat([sweep, pl.DataFrame([_row(n, "sp", source="simulated") for n in TOKENS])])
    latency.update_latency_figure(fig, more, async_tp_min_tokens=128)
    assert len(sp_trace.x) == len(TOKENS)  # the same trace object, now with every point
    # New series are appended: the simulated curve and the regret of the gate within the simulated rows.
    assert [t.name for t in fig.data[n_traces:]] == ["sp (simulated)", "regret: gated (simulated)"]
    assert fig.data[-1].yaxis == "y2" and fig.data[-1].line.dash == "dash"


def test_bad_and_empty_input():
    with pytest.raises(ValueError, match="lack columns.*fusion_missing"):
        latency.latency_data(pl.DataFrame({"num_tokens": [1], "variant": ["sp"], "latency_us": [1.0]}))
    empty = latency.latency_data(pl.DataFrame())
    assert empty.series == () and empty.regret.height == 0
    assert isinstance(latency.plot_latency([]), go.Figure)
