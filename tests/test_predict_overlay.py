"""Predicted curves where users decide: the tuner's overlay (drawn apart, never in the regret) and the
report's "what this would be on 8x H200" section (labelled predicted)."""

from __future__ import annotations

import polars as pl
import pytest

pytest.importorskip("plotly", reason="the overlay draws with plotly")
from test_cli import curve_rows
from test_tuner import LATENCY, TOKENS, _row

from sp_lab import cli
from sp_lab.bench.store import SweepStore
from sp_lab.viz.predicted import add_predicted_curves, report_setup
from sp_lab.widgets.tuner import tune


def test_tuner_overlay_is_drawn_apart_and_never_in_the_regret(tmp_path):
    rows = pl.DataFrame([_row(v, t) for v in LATENCY for t in TOKENS])
    tuner = tune("toy", tp=2, token_counts=TOKENS, store_dir=None, export_dir=tmp_path, replay=rows)
    regret, rec = tuner.state.regret(), tuner.state.recommendation()
    height = tuner.figure.layout.height
    tuner.overlay_prediction("llama-3-70b", "h200", 8)
    # Its legend rows (a group title and a curve each, below the plot) make the figure taller, not the plot smaller.
    assert tuner.figure.layout.height == height + 20 * 4
    drawn = [t for t in tuner.figure.data if str(t.meta).startswith("predicted:")]
    assert {t.name for t in drawn} == {"baseline (predicted)", "sp (predicted)", "sp+async_tp (predicted)"}
    assert all(t.line.dash == "dash" and t.legendgroup == "predicted" for t in drawn)
    assert drawn[0].legendgrouptitle.text == "predicted: llama-3-70b, 8x H200 SXM 141GB"
    # the rows the regret and the recommendation read are still the measured ones alone
    assert tuner.state.rows["source"].unique().to_list() == ["measured"]
    assert tuner.state.regret().equals(regret) and tuner.state.recommendation().policy == rec.policy
    assert "predicted overlay: llama-3-70b" in tuner.status.value
    tuner.overlay_prediction("llama-3-70b", "h300", 8)
    assert "unknown GPU 'h300'; allowed:" in tuner.status.value
    tuner.overlay_prediction("")
    assert not [t for t in tuner.figure.data if str(t.meta).startswith("predicted:")]


def test_only_predicted_rows_are_drawn_as_predictions():
    import plotly.graph_objects as go

    with pytest.raises(ValueError, match="source='predicted' rows only"):
        add_predicted_curves(go.Figure(), pl.DataFrame([_row("baseline", 1)]), subplot=False)


def test_report_has_a_predicted_section_for_a_real_preset(tmp_path):
    store = tmp_path / "sweeps"
    SweepStore(store).append(curve_rows())  # model "toy": not a preset, so the section shows llama-3-70b
    out = tmp_path / "report.html"
    assert cli.main(["report", "--store", str(store), "--out", str(out), "--cdn"]) == 0
    page = out.read_text()
    section = page[page.index("What this would be on 8x H200 (predicted)"):]
    assert "(source: predicted)" in section and "<code>llama-3-70b</code>" in section
    assert "Predicted config (source: predicted)" in section and "--export-predicted" in section
    assert report_setup("llama-3-8b") == ("llama-3-8b", 8) and report_setup("qwen2.5-7b") == ("qwen2.5-7b", 4)
