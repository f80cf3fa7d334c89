"""Tests for sp_lab.viz.graph: assertions on the data layer, smoke renders of the figures.

Reports come from tests/data/synthetic_*.json (written by tests/synthetic_reports.py; SYNTHETIC,
shaped after the CompileReport schema until the compiler's own reports replace them).
"""

from __future__ import annotations

import json
import logging
import warnings

import polars as pl
import pytest

go = pytest.importorskip("plotly.graph_objects", reason="plotly is optional on GPU machines")
import synthetic_reports as sr

from sp_lab.viz import graph

FIXTURES = {
    (model, strategy): sr.DATA_DIR / f"synthetic_{model}_{strategy}.json"
    for model in ("toy", "toy_inplace", "llama") for strategy in sr.STRATEGIES
}
LAYERS = {"toy": 2, "toy_inplace": 2, "llama": 4}


@pytest.fixture(scope="module")
def reports() -> dict:
    return {key: graph.load_report(path) for key, path in FIXTURES.items()}


def _all_text(fig: go.Figure) -> str:
    return "\n".join(str(t) for trace in fig.data for t in (trace.text or ()) if t is not None)


def test_fixtures_match_generator(tmp_path):
    """The saved JSON must be what the generator writes today, or tests read stale shapes."""
    for path in sr.write_fixtures(tmp_path):
        saved = sr.DATA_DIR / path.name
        assert json.loads(saved.read_text()) == json.loads(path.read_text()), (
            f"{saved} is stale: run python tests/synthetic_reports.py")


# ------------------------------------------------------------------------------------------ overview

@pytest.mark.parametrize("key", sorted(FIXTURES), ids=lambda k: "-".join(k))
def test_overview_structure_every_strategy(reports, key):
    model, strategy = key
    data = graph.overview_data(reports[key])
    n_layers = LAYERS[model]
    assert len(data.pieces) == 2 * n_layers + 1
    assert [p.kind for p in data.pieces[:3]] == ["compiled", "splitting_op", "compiled"]
    assert len(data.boundaries) == 2 * n_layers
    residual = [t for b in data.boundaries for t in b.tensors if t.name == "residual"]
    assert residual and all(t.sharded_after == (strategy in ("sharded", "none")) for t in residual)
    if strategy in ("sharded", "none"):
        assert all(t.shape_after[0] == "(s0 + 1)//2" for t in residual)
    else:
        assert all(t.shape_after == t.shape_before for t in residual)
    # Every piece appears exactly once in the collapsed lane.
    covered = [i for item in data.lane() for i in (item.pieces if isinstance(item, graph.PieceGroup) else [item.index])]
    assert covered == [p.index for p in data.pieces]
    fig = graph.build_overview_figure(data)
    assert isinstance(fig, go.Figure) and "tokens 1-127" in fig.layout.title.text


@pytest.mark.parametrize("model", ["toy", "toy_inplace", "llama"])
def test_strategy_none_marks_failing_boundary_with_check_and_shapes(reports, model):
    data = graph.overview_data(reports[(model, "none")])
    (failure,) = data.failures
    expected_check = "copy_epilogue" if model == "toy_inplace" else "assert_size_stride"
    assert failure.check == expected_check and failure.piece == 2
    assert failure.boundary == 1  # the cut attention(1) -> piece 2 fed the bad residual
    assert data.boundaries[1].failures == (failure,)
    assert failure.expected_shape[0] == "s0" and failure.actual_shape[0] == "(s0 + 1)//2"
    assert data.range.compiled == (model != "toy_inplace")  # copy_ fails at compile time, the guard at run time
    text = _all_text(graph.build_overview_figure(data))
    assert expected_check in text and "expected [s0," in text and "got [(s0 + 1)//2," in text


def test_gather_erase_marks_erased_copies_unsafe(reports):
    data = graph.overview_data(reports[("toy_inplace", "gather_erase")])
    assert data.range.numerically_unsafe
    assert [e.piece for e in data.erased] == [2]  # middle compiled pieces only
    assert "unsafe: copy_ erased" in _all_text(graph.build_overview_figure(data))
    # Out-of-place residuals have no copy_ to erase: the same strategy is safe there.
    safe = graph.overview_data(reports[("toy", "gather_erase")])
    assert not safe.erased and not safe.range.numerically_unsafe
    assert "unsafe" not in _all_text(graph.build_overview_figure(safe))


def test_sharded_tensors_drawn_apart_from_full(reports):
    fig = graph.build_overview_figure(graph.overview_data(reports[("llama", "sharded")]))
    by_name = {t.name: t for t in fig.data if t.name}
    assert all("sharded" in s for s in by_name["sharded tensor"].text)
    assert not any("sharded" in s for s in by_name["full tensor"].text)
    assert by_name["sharded tensor"].textfont.color != by_name["full tensor"].textfont.color


def test_identical_layers_collapse_and_expand():
    report = sr.make_report(sr.LLAMA_3_8B, num_layers=32, strategy="sharded")
    data = graph.overview_data(report)
    (group,) = data.groups
    assert group.label == "pieces 2-62 x31" and group.period == 2 and group.repeats == 31
    assert len(data.lane()) == 5  # piece 0, attention 1, the group, attention 63, the last piece
    assert [type(i).__name__ for i in data.lane()] == ["PieceBox", "PieceBox", "PieceGroup", "PieceBox", "PieceBox"]
    assert len(data.lane(expand=True)) == len(data.pieces) == len(data.lane(expand=[group.id]))
    collapsed = graph.plot_overview(report)
    expanded = graph.plot_overview(report, expand=True)
    assert "pieces 2-62 x31" in _all_text(collapsed) and "pieces 2-62" not in _all_text(expanded)
    with pytest.raises(ValueError, match="g7.*g0 \\(pieces 2-62 x31\\)"):
        data.lane(expand=["g7"])


def test_a_different_layer_splits_the_run():
    report = sr.make_report(sr.LLAMA_3_8B, num_layers=8, strategy="sharded")
    report["ranges"][0]["pieces"][8]["fingerprint"] = "a layer the passes treated differently"
    labels = [g.label for g in graph.overview_data(report, 0).groups]
    assert labels == ["pieces 2-6 x3", "pieces 10-14 x3"]


def test_range_selection_and_errors(reports):
    report = reports[("toy", "sharded")]
    assert graph.overview_data(report, 1).range.enable_async_tp
    assert graph.overview_data(report, -1).range.index == 1
    with pytest.raises(IndexError, match="0: tokens 1-127, 1: tokens 128-16384"):
        graph.overview_data(report, 5)
    with pytest.raises(ValueError, match="schema"):
        graph.overview_data({"schema": "something/else", "ranges": [{}]})
    with pytest.raises(FileNotFoundError, match="to_json"):
        graph.load_report("/nonexistent/report.json")

    class ReportLike:  # the compiler's CompileReport exposes to_dict()
        def to_dict(self):
            return report

    assert graph.overview_data(ReportLike()).pieces == graph.overview_data(report).pieces


def test_overview_of_80_layer_70b_report_is_fast():
    """The issue's bar (< 2 s on CPU); benchmarks/bench_explorer.py measures it properly."""
    import time

    report = sr.llama_70b_tp8_report()
    start = time.perf_counter()
    data = graph.overview_data(report)
    fig = graph.build_overview_figure(data)
    elapsed = time.perf_counter() - start
    assert len(data.pieces) == 161 and [g.label for g in data.groups] == ["pieces 2-158 x79"]
    assert "pieces 2-158 x79" in _all_text(fig)
    assert elapsed < 2.0, f"overview took {elapsed:.2f} s"


def test_uncompiled_range_is_skipped_by_default_and_explained(reports):
    # The compiler builds ranges lazily: a range no token count has hit yet has no pieces.
    report = json.loads(json.dumps(reports[("toy", "sharded")]))
    report["ranges"][0].update(pieces=[], boundaries=[], compiled=False, compile_time_s=0.0)
    assert graph.overview_data(report).range.index == 1
    empty = graph.overview_data(report, 0)
    assert empty.pieces == () and empty.lane() == []
    assert "not compiled yet" in graph.build_overview_figure(empty).layout.title.text
    with pytest.raises(IndexError, match="not compiled"):
        graph.piece_diff_data(report, 0, 2)


# ------------------------------------------------------------------------------------------ drill-down

def test_piece_diff_shows_what_the_passes_changed(reports):
    diff = graph.piece_diff_data(reports[("llama", "sharded")], range_index=1, piece_index=2)
    added_kinds = {n.kind for n in diff.after.nodes if n.changed}
    assert {"fused"} <= added_kinds
    assert {n.name for n in diff.after.nodes if n.changed} == set(diff.added)
    assert {n.name for n in diff.before.nodes if n.changed} == set(diff.removed)
    assert any(n.startswith("all_reduce") for n in diff.removed)
    counts = {r["op"]: r for r in diff.op_counts.iter_rows(named=True)}
    assert counts["all_reduce"]["delta"] == -2 and counts["fused_matmul_reduce_scatter"]["after"] == 2
    for layout in (diff.before, diff.after):
        depth = {n.name: n.depth for n in layout.nodes}
        assert all(depth[b] > depth[a] for a, b in layout.edges)
        for n in (n for n in layout.nodes if n.kind == "input"):  # inputs sit just before their first reader
            assert depth[n.name] == min(depth[b] for a, b in layout.edges if a == n.name) - 1
    fig = graph.plot_piece(reports[("llama", "sharded")], 2, range_index=1)
    widths = [w for t in fig.data if t.marker and t.marker.line and t.marker.line.width is not None
              for w in (t.marker.line.width if isinstance(t.marker.line.width, tuple) else ())]
    assert max(widths) > min(widths)  # changed nodes are outlined thicker
    assert "all_reduce 2→0" in fig.layout.title.text


def test_splitting_op_piece_is_unchanged(reports):
    diff = graph.piece_diff_data(reports[("toy", "sharded")], piece_index=1)
    assert diff.piece.kind == "splitting_op" and not diff.added and not diff.removed
    with pytest.raises(IndexError, match="piece_index=99"):
        graph.piece_diff_data(reports[("toy", "sharded")], piece_index=99)


def test_layered_layout_rejects_cycles():
    cyclic = {"nodes": [{"name": "a"}, {"name": "b"}], "edges": [["a", "b"], ["b", "a"]]}
    with pytest.raises(ValueError, match="cycle"):
        graph.layered_layout(cyclic)


# ------------------------------------------------------------------------------------------ compare

def test_compare_gather_vs_sharded(reports):
    frame = graph.compare_data(reports[("llama", "gather")], reports[("llama", "sharded")], range_a=1, range_b=1)
    row = {r["metric"]: r for r in frame.iter_rows(named=True)}
    # The sharded boundary hands over half the residual bytes (tp 2) and drops the boundary all_gathers.
    assert row["boundary bytes/token"]["b"] < row["boundary bytes/token"]["a"]
    assert row["all_gather/layer"]["b"] < row["all_gather/layer"]["a"]
    assert row["sharded tensors at boundaries"]["a"] == 0 and row["sharded tensors at boundaries"]["b"] == 8
    assert row["fused ops"]["a"] > 0 and row["fused ops"]["b"] > 0
    assert frame["label_a"][0] == "llama-3-8b gather tokens 128-16384"
    fig = graph.plot_compare(reports[("llama", "gather")], reports[("llama", "sharded")])
    assert sum(isinstance(t, go.Bar) for t in fig.data) == 2 * 4


def test_compare_two_ranges_of_one_report(reports):
    report = reports[("toy", "sharded")]
    frame = graph.compare_data(report, report, range_a=0, range_b=1)
    row = {r["metric"]: r for r in frame.iter_rows(named=True)}
    assert row["fused ops"]["a"] == 0 and row["fused ops"]["b"] > 0  # AsyncTP only in range 1
    assert row["reduce_scatter/layer"]["ratio"] < 1


# ------------------------------------------------------------------------------------------ tables

def test_piece_table(reports):
    report = reports[("llama", "gather")]
    table = graph.piece_table(report)
    assert table.height == sum(len(r["pieces"]) for r in report["ranges"])
    assert {"match_sp_middle", "before_all_reduce", "after_fused_all_gather_matmul", "cache_hit",
            "compile_time_s"} <= set(table.columns)
    expected = sum(p["matches"]["boundary_gather"] for r in report["ranges"] for p in r["pieces"])
    assert table["match_boundary_gather"].sum() == expected > 0
    assert table.filter(pl.col("kind") == "splitting_op")["cache_hit"].null_count() == 2 * LAYERS["llama"]


def test_range_table(reports):
    table = graph.range_table(reports[("toy_inplace", "gather_erase")])
    assert table["numerically_unsafe"].to_list() == [True, True]
    assert table["enable_async_tp"].to_list() == [False, True]


# ------------------------------------------------------------------------------------------ export

def test_save_html_writes_all_figures(tmp_path, reports):
    report = reports[("toy", "none")]
    figs = [graph.plot_overview(report), graph.plot_piece(report, 2)]
    path = graph.save_html(figs, tmp_path / "out" / "report.html")
    html = path.read_text()
    assert html.count("Plotly.newPlot") == 2
    assert "plotly.js" in html.lower() and len(html) > 1_000_000  # embedded: opens offline
    with pytest.raises(ValueError, match="at least one"):
        graph.save_html([], tmp_path / "x.html")


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_emit_trace_sends_report_artifact(monkeypatch, reports):
    from torch._logging._internal import trace_log

    report = reports[("toy", "sharded")]
    handler = _Capture()
    # Only our handler: torch's LazyTraceHandler removes itself on its first record when TORCH_TRACE is
    # unset, which makes logging skip the next handler for that record.
    monkeypatch.setattr(trace_log, "handlers", [handler])
    assert graph.emit_trace(report)
    names = [r.metadata["artifact"]["name"] for r in handler.records]
    assert names == ["sp_lab_compile_report", "sp_lab_overview_0", "sp_lab_overview_1"]
    assert json.loads(handler.records[0].payload) == report
    overview = json.loads(handler.records[1].payload)
    assert overview["range"]["lo"] == 1 and len(overview["pieces"]) == 5


def test_emit_trace_warns_on_incompatible_torch(monkeypatch, reports):
    import torch._logging

    monkeypatch.setattr(torch._logging, "trace_structured", lambda name, payload: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert graph.emit_trace(reports[("toy", "sharded")]) is False
    assert any("metadata_fn" in str(w.message) for w in caught)


# ------------------------------------------------------------------------------------------ widgets

def test_widget_figure_and_explorer(reports):
    from sp_lab.widgets.explorer import explore

    assert isinstance(graph.plot_overview(reports[("toy", "sharded")], widget=True), go.FigureWidget)
    report = sr.make_report(sr.LLAMA_3_8B, num_layers=6)
    ex = explore(report)
    collapsed = _all_text(ex.overview_figure)
    assert "pieces 2-10 x5" in collapsed and ex.expanded == []
    ex.group_toggles.children[0].value = True
    assert ex.expanded == ["g0"] and "pieces 2-10 x5" not in _all_text(ex.overview_figure)
    ex.piece_select.value = 4
    assert ex.piece_figure.layout.title.text.startswith("submod_4")
    ex.range_select.value = 1
    assert ex.data.range.index == 1 and ex.expanded == []
