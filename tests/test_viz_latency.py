"""Tests for sp_lab.viz.latency: assertions on series / thresholds / regret, smoke renders."""

from __future__ import annotations

import math
import re

import polars as pl
import pytest

from sp_lab.config import LabConfig
from sp_lab.tuning.regret import regret_table

go = pytest.importorskip("plotly.graph_objects", reason="plotly is optional on GPU machines")
from sp_lab.viz import latency
from sp_lab.viz.live_figure import LiveFigure  # after the skip: it imports plotly

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
    data = latency.latency_data(rows, config=LabConfig(async_tp_min_tokens=128))
    series = _series(data)
    missing = series["sp+async_tp [fusion missing]"]
    assert missing.hollow and missing.dash == "dot" and missing.points["num_tokens"].to_list() == [4096]
    assert 4096 not in series["sp+async_tp"].points["num_tokens"].to_list()
    assert not data.regret.filter(pl.col("best_us") == 1.0).height  # never "best" either
    fig = latency.build_latency_figure(data)
    trace = next(t for t in fig.data if t.name == "sp+async_tp [fusion missing]")
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


def test_thresholds_and_regret_are_the_regret_table_of_the_config(sweep):
    config = LabConfig(async_tp_min_tokens=128)
    data = latency.latency_data(sweep, config=config, vllm_min_tokens=1024)
    assert [(t.name, t.num_tokens) for t in data.thresholds] == [("async_tp", 128), ("vllm", 1024)]
    table = regret_table(sweep, config)
    assert data.regret.drop("group", "source").equals(table)  # the panel is the one regret, not a copy of it
    ran = dict(zip(table["num_tokens"].to_list(), table["variant_run"].to_list(), strict=True))
    assert ran == {n: ("baseline" if n < 128 else "sp+async_tp") for n in TOKENS}
    by_n = {r["num_tokens"]: r for r in table.iter_rows(named=True)}
    # At 128 tokens the gate already fuses but fusion still loses to sp: 1.5 / 0.97 - 1.
    assert by_n[128]["best_variant"] == "sp" and by_n[128]["regret_rel"] == pytest.approx(1.5 / 0.97 - 1)
    assert by_n[1]["regret_rel"] == pytest.approx(1 / 0.97 - 1) and by_n[8192]["regret_rel"] == 0.0

    fig = latency.build_latency_figure(data)
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis2.type == "log"
    assert "us" in fig.layout.yaxis.title.text and fig.layout.yaxis2.ticksuffix == "%"
    # a percentage axis from 0 that holds the worst regret
    assert fig.layout.yaxis2.range[0] == 0 and fig.layout.yaxis2.range[1] >= 100 * table["regret_rel"].max()
    # the shared token axis is labelled at the measured counts, on both panels
    assert list(fig.layout.xaxis2.tickvals) == list(TOKENS) and list(fig.layout.xaxis2.ticktext) == [str(n) for n in TOKENS]
    assert list(fig.layout.xaxis.tickvals) == list(TOKENS)
    assert "source: measured" in fig.layout.title.text
    titles = [a.text for a in fig.layout.annotations if a.xref != "x"]
    assert not any("source:" in t for t in titles), titles  # the source is said once, in the title
    assert sorted(s.x0 for s in fig.layout.shapes) == [128, 1024]
    labels = {a.text: a.x for a in fig.layout.annotations if a.xref == "x"}
    assert labels == pytest.approx({"async_tp_min_tokens=128": math.log10(128),
                                    "vLLM sp_min_token_num=1024": math.log10(1024)})
    # what is plotted equals the table: the regret panel in percent, the black curve in us
    (regret,) = [t for t in fig.data if t.yaxis == "y2"]
    assert list(regret.x) == table["num_tokens"].to_list()
    assert list(regret.y) == pytest.approx([100 * r for r in table["regret_rel"].to_list()])
    curve = next(t for t in fig.data if t.meta == latency.CONFIG_META)
    assert list(curve.y) == pytest.approx(table["latency_us"].to_list())


def test_intervals_are_drawn_when_rows_carry_them(sweep):
    rows = sweep.with_columns(ci_low_us=pl.col("latency_us") - 1.0, ci_high_us=pl.col("latency_us") + 2.0)
    data = latency.latency_data(rows)
    assert data.error_bars == "95% CI of the median"
    trace = next(t for t in latency.build_latency_figure(data).data if t.name == "sp")
    assert list(trace.error_y.array) == pytest.approx([2.0] * len(TOKENS))
    assert list(trace.error_y.arrayminus) == pytest.approx([1.0] * len(TOKENS))
    # rows without an interval get no bar (not a p10-p90 bar under the same name), and the axis says so
    bare = latency.latency_data(sweep)
    assert bare.error_bars.startswith("95% CI of the median") and "none recorded" in bare.error_bars
    trace = next(t for t in latency.build_latency_figure(bare).data if t.name == "sp")
    assert len(trace.error_y.array) == len(TOKENS) and all(v is None for v in trace.error_y.array)


def test_zero_regret_reads_as_zero_percent_not_noise(sweep):
    """A config that runs the fastest variant everywhere: the regret panel is 0% on a 0-5% axis, said in words."""
    best = sweep.group_by("num_tokens").agg(pl.col("latency_us").min())
    fastest_everywhere = sweep.join(best, on=["num_tokens", "latency_us"]).with_columns(variant=pl.lit("baseline"))
    data = latency.latency_data(fastest_everywhere, config=LabConfig(enable_sp=False, enable_async_tp=False))
    assert data.regret.height and data.regret["regret_rel"].max() == 0.0
    fig = latency.build_latency_figure(data)
    assert tuple(fig.layout.yaxis2.range) == (0, 5.0) and fig.layout.yaxis2.ticksuffix == "%"
    assert any("0% regret at every measured token count" in a.text for a in fig.layout.annotations)


def test_no_config_means_no_regret(sweep):
    data = latency.latency_data(sweep)
    assert data.regret.height == 0 and not data.thresholds and data.config_name is None


def test_widget_is_a_live_figure_of_the_same_figure(sweep):
    view = latency.plot_latency(sweep, widget=True)
    assert isinstance(view, LiveFigure)
    assert view.figure["layout"]["title"]["text"] == latency.plot_latency(sweep).layout.title.text


def test_every_figure_names_device_and_torch_of_its_rows_whatever_its_title(sweep):
    """A single machine's measured curve used to show neither its device nor its torch: the title's provenance
    line says both (and model, tp, boundary, dtype, source), under a caller's own title too."""
    line = "model toy · tp 2 · device cpu · torch 2.13.0+cpu · boundary sharded · dtype float32 · source: measured"
    assert latency.provenance_line(sweep) == line
    for title in (None, "my sweep"):
        first, *under = latency.plot_latency(sweep, title=title).layout.title.text.split("<br>")
        assert first == (title or "Forward latency vs tokens")
        assert " · ".join(re.sub("</?sup>", "", u) for u in under) == line  # wrapped (see the next test), all said
    two = pl.concat([sweep, sweep.with_columns(device_name=pl.lit("NVIDIA H200"), torch_version=pl.lit("2.9.0"))])
    assert "device: 2 values (see the legend) · torch: 2 values (see the legend)" in latency.provenance_line(two)
    assert {s.label for s in latency.latency_data(two).series} >= {
        "sp · device_name=cpu, torch_version=2.13.0+cpu", "sp · device_name=NVIDIA H200, torch_version=2.9.0"}
    assert latency.provenance_line(pl.DataFrame()) == "no rows yet"


def _lines(text: str) -> list[str]:
    return re.sub("</?sup>", "", text).split("<br>")


def test_the_layout_reads_at_a_notebooks_width(sweep):
    """Where plotly puts things, read from the layout (not pixels): a replay of three machines (a dozen legend
    entries, wrapping onto several lines) with a config whose name is long."""
    many = pl.concat([sweep.with_columns(device_name=pl.lit(d))
                      for d in ("cpu", "NVIDIA H200", "NVIDIA H100 80GB HBM3")])
    config = LabConfig(async_tp_min_tokens=128, heuristic=None)
    fig = latency.plot_latency(many, config=config, title="a caller's title that is long enough to need a second "
                                                          "line at the width of a notebook's output area")
    legend, title = fig.layout.legend, fig.layout.title
    assert len([t for t in fig.data if t.showlegend is not False]) >= 12
    # The config's curve is drawn per machine, each left to right (one line through all three zigzagged).
    configs = [t for t in fig.data if t.meta == latency.CONFIG_META]
    assert len(configs) == 3 and all(list(t.x) == sorted(t.x) for t in configs)
    # The legend at the figure's bottom edge, where plotly.js reserves the room it takes however many lines it
    # wraps onto; the title at the top edge, in a top margin sized for its lines: the legend never covers it
    # (above the plot, a wrapping legend grew upwards over the title).
    assert (legend.orientation, legend.yref, legend.yanchor, legend.y) == ("h", "container", "bottom", 0)
    assert (title.yref, title.yanchor, title.y) == ("container", "top", 1)
    assert fig.layout.margin.t >= 30 + 22 * len(_lines(title.text))  # its padding and every line above the plot
    # No line of the title or of a subplot title wider than the output area (a centred long line is cut at both
    # ends), and nothing dropped by the wrapping.
    subplot_titles = [a.text for a in fig.layout.annotations if a.xref == "paper"]
    assert len(subplot_titles) == 2 and "config: baseline below 128, sp+async_tp from 128" in subplot_titles[1]
    for text in (title.text, *subplot_titles):
        assert all(len(line) <= latency.TITLE_CHARS for line in _lines(text)), _lines(text)
    assert "a caller's title that is long enough" in title.text and "source: measured" in title.text
    # Log axes label whole values, none of their minor ticks ("2 3 5" between decades read as values).
    for axis in (fig.layout.xaxis, fig.layout.xaxis2, fig.layout.yaxis):
        assert (axis.type, axis.minorloglabels, axis.exponentformat) == ("log", "none", "none")


def test_titles_wrap_at_separators_and_keep_every_word():
    text = "model toy · tp 2 · device cpu: AMD EPYC 7B13 64-Core Processor · torch 2.13.0+cpu · boundary sharded"
    lines = latency.wrap_title(text, width=64)
    assert lines == ["model toy · tp 2 · device cpu: AMD EPYC 7B13 64-Core Processor",
                     "torch 2.13.0+cpu · boundary sharded"]
    assert latency.wrap_title("one two three four", width=9) == ["one two", "three", "four"]


def test_modelled_rows_are_dashed_curves_and_regret_lines_alike(sweep):
    """Predicted (and simulated) rows: dashed curve, dashed regret line; rehearsal dash-dotted; measured solid."""
    config = LabConfig(async_tp_min_tokens=128)
    for source, dash in (("predicted", "dash"), ("simulated", "dash"), ("rehearsal", "dashdot"),
                         ("measured", "solid")):
        fig = latency.plot_latency(sweep.with_columns(source=pl.lit(source)), config=config)
        curves = [t for t in fig.data if str(t.meta).startswith("latency:")]
        (regret,) = [t for t in fig.data if str(t.meta).startswith("regret:")]
        assert {t.line.dash for t in curves} == {dash} and regret.line.dash == dash, source


def test_bad_and_empty_input():
    with pytest.raises(ValueError, match="lack columns.*fusion_missing"):
        latency.latency_data(pl.DataFrame({"num_tokens": [1], "variant": ["sp"], "latency_us": [1.0]}))
    empty = latency.latency_data(pl.DataFrame())
    assert empty.series == () and empty.regret.height == 0
    assert isinstance(latency.plot_latency([]), go.Figure)
