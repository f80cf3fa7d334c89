"""Tests for the split-graph explorer (sp_lab.viz): assertions on the data layer, smoke renders of the figures.

Every report is a REAL one: ``tests/data/explorer/<model>_<strategy>.json.gz``, written by
``tests/data/make_explorer_fixtures.py`` (toy, toy with an in-place residual, a llama-3-8b-shaped model; every
boundary strategy; tp 2 under the fake process group). Regenerate them when the report format changes.
"""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import warnings
from pathlib import Path

import polars as pl
import pytest

go = pytest.importorskip("plotly.graph_objects", reason="plotly is optional on GPU machines")

from sp_lab.compiler.report import CompileReport
from sp_lab.viz import dag_layout
from sp_lab.viz import explorer as graph
from sp_lab.viz.piece_graph import is_folded

DATA = Path(__file__).parent / "data" / "explorer"
MODELS = ("toy", "toy_inplace", "llama")
STRATEGIES = ("none", "gather_erase", "gather", "sharded")
TP = 2
HIDDEN = {"toy": 64, "toy_inplace": 64, "llama": 128}  # float32: 4 bytes per element
# (query heads, KV heads, head dim) of each fixture model before tp sharding (make_explorer_fixtures.py)
ATTENTION = {"toy": (4, 2, 16), "toy_inplace": (4, 2, 16), "llama": (4, 2, 32)}


def _path(model: str, strategy: str) -> Path:
    return DATA / f"{model}_{strategy}.json.gz"


@pytest.fixture(scope="module")
def reports() -> dict:
    return {(m, s): graph.load_report(_path(m, s)) for m, s in itertools.product(MODELS, STRATEGIES)}


def _all_text(fig: go.Figure) -> str:
    return "\n".join(str(t) for trace in fig.data for t in (trace.text or ()) if t is not None)


ALL = list(itertools.product(MODELS, STRATEGIES))
IDS = ["-".join(k) for k in ALL]


# ------------------------------------------------------------------------------------------ fixtures

@pytest.mark.parametrize("key", ALL, ids=IDS)
def test_fixture_is_what_the_compiler_reads_back(key):
    """The compiler's strict loader accepts every fixture: they are in today's report format (else regenerate)."""
    from sp_lab.compiler.report import CompileReport

    data = json.loads(gzip.decompress(_path(*key).read_bytes()))
    report = CompileReport.from_dict(data)
    assert report.provenance["backend"] == "fake" and report.provenance["tp_size"] == TP
    assert [r.enable_sp for r in report.ranges] == [False, True]


# ------------------------------------------------------------------------------------------ overview

@pytest.mark.parametrize("key", [k for k in ALL if k != ("toy_inplace", "none")], ids=lambda k: "-".join(k))
def test_overview_pieces_say_what_they_run(reports, key):
    model, strategy = key
    data = graph.overview_data(reports[key])
    assert data.range_index == 1 and data.range.enable_sp and data.range.enable_async_tp  # default: the SP range
    assert [p.kind for p in data.pieces] == ["compiled", "splitting_op"] * 2 + ["compiled"]
    ops = [p.ops_text for p in data.pieces if p.kind == "compiled"]
    # Every piece fuses AsyncTP's matmuls; the last all-gathers for the final norm's output.
    assert ops[0].endswith("1 AG+mm") and ops[1].endswith("2 AG+mm · 2 mm+RS") and ops[2].endswith("2 AG+mm · 2 mm+RS")
    # gather keeps the in-place residual's copy_ and all-gathers into it: one more AG in the last piece.
    assert ops[2].startswith("2 AG ·" if key == ("toy_inplace", "gather") else "1 AG ·")
    if strategy in ("gather", "gather_erase"):
        # The re-gather at the boundary: every piece that hands a residual on all-gathers it...
        assert ops[0] == "1 RS · 1 AG · 1 AG+mm"
        if not (model == "toy_inplace" and strategy == "gather_erase"):
            assert ops[1].startswith("1 AG ·")
        else:  # ...except where gather_erase erased the in-place residual's copy_: no gather, the write is lost
            assert ops[1] == "2 AG+mm · 2 mm+RS"
    else:  # sharded (and none): the residual leaves piece 0 as a shard; nothing re-gathers it
        assert ops[:2] == ["1 RS · 1 AG+mm", "2 AG+mm · 2 mm+RS"]
    for p in data.pieces:
        assert (p.compile_text != "") == (p.kind == "compiled")
    fig = graph.build_overview_figure(data)
    text = _all_text(fig)
    assert all(o.split(" · ")[0] in text for o in ops) and "B/tok" in text


@pytest.mark.parametrize("model", MODELS)
def test_boundary_tensors_carry_the_models_names_in_every_strategy(reports, model):
    """Names a person knows (the model's variables), the same whichever boundary strategy compiled the model, and
    the same in the piece view's graph inputs."""
    names = {}
    # (the in-place residual's "none" failed while compiling its SP range: no pieces, no boundaries there)
    for strategy in [s for s in STRATEGIES if (model, s) != ("toy_inplace", "none")]:
        data = graph.overview_data(reports[(model, strategy)])
        names[strategy] = [sorted(t.name for t in b.tensors) for b in data.boundaries]
        assert all("residual" in b for b in names[strategy]) and "positions" in names[strategy][0], names[strategy]
        assert not any(n.startswith(("getitem", "arg")) for b in names[strategy] for n in b)
        for b in data.boundaries:
            residual = next(t for t in b.tensors if t.name == "residual")
            assert residual.sharded_after == (strategy in ("sharded", "none"))
            assert "residual [" in graph.crossing_text(residual)
    assert len({str(v) for v in names.values()}) == 1, names
    # The piece view names the graph inputs that crossed a boundary the same way.
    diff = graph.piece_diff_data(reports[(model, "sharded")], None, 2)
    inputs = {n.ops[0] for n in diff.after.nodes if n.kind == "input"}
    assert {"residual", "positions"} <= inputs, inputs


@pytest.mark.parametrize("model", MODELS)
def test_boundary_bytes_per_token_sharded_vs_full(reports, model):
    """The sharded residual hands over hidden*4/tp bytes per token; gather the full hidden*4."""
    residual = HIDDEN[model] * 4
    gather = graph.overview_data(reports[(model, "gather")]).boundaries
    sharded = graph.overview_data(reports[(model, "sharded")]).boundaries
    assert len(gather) == len(sharded) == 2
    heads, kv_heads, head_dim = ATTENTION[model]
    qkv = (heads + 2 * kv_heads) // TP * head_dim * 4  # this rank's q, k and v heads, float32, per token
    for i, (g, s) in enumerate(zip(gather, sharded)):
        # int64 positions cross the first boundary only: the second layer's rotary embedding is before it
        positions = 8 if i == 0 else 0
        assert g.bytes_per_token == qkv + residual + positions
        assert s.bytes_per_token == qkv + residual / TP + positions
        assert g.sharded_bytes_per_token == 0
        assert s.sharded_bytes_per_token == residual / TP
        assert [t.sharded_after for t in s.tensors].count(True) == 1
    assert f"{sharded[0].sharded_bytes_per_token:,.0f} sharded" in sharded[0].text


@pytest.mark.parametrize("model", ["toy", "llama"])
def test_none_fails_at_the_guard_and_is_drawn_red(reports, model):
    data = graph.overview_data(reports[(model, "none")])
    (failure,) = data.failures
    assert failure.check == "assert_size_stride" and failure.piece == 2 and failure.boundary == 0
    assert data.boundaries[0].failures == (failure,)
    # The model's name, as the boundary it crossed lists it (the report of an older compiler said Dynamo's "hidden").
    assert failure.tensor == "residual" and "residual" in {t.name for t in data.boundaries[0].tensors}
    # Raised at the first call, 13 tokens: the piece was compiled for all of them and got ceil(13 / tp).
    assert str(failure.expected_shape[0]).startswith("s") and failure.actual_shape[0] == (13 + 1) // TP
    assert failure.expected_shape[1:] == failure.actual_shape[1:] == (HIDDEN[model],)
    fig = graph.build_overview_figure(data)
    failed = [t for t in fig.data if t.name == "failed check"]
    assert failed and failed[0].line.color == "#d62728"  # the failing piece's box, red
    assert "assert_size_stride failed (piece 2)" in _all_text(fig)


def test_in_place_none_fails_while_compiling_and_is_still_drawn(reports):
    """A real in-place ``none`` failure raises while compiling and leaves no pieces: the overview must not say
    "not compiled yet"; it draws the failure in red."""
    data = graph.overview_data(reports[("toy_inplace", "none")])
    assert data.range_index == 1 and not data.range.compiled and data.pieces == ()
    (failure,) = data.failures
    assert failure.check == "copy_epilogue" and failure.piece == 2 and failure.boundary is None
    fig = graph.build_overview_figure(data)
    assert failure.tensor == "residual" and "on residual" in _all_text(fig)  # not AOT's placeholder "arg3_1"
    title = fig.layout.title.text
    assert "compile failed" in title and "not compiled yet" not in title
    assert "copy_epilogue failed (piece 2)" in _all_text(fig) and any(t.name == "failed check" for t in fig.data)
    with pytest.raises(IndexError, match="compile failed"):
        graph.piece_diff_data(reports[("toy_inplace", "none")], None, 2)


def test_gather_erase_marks_erased_copies_unsafe(reports):
    data = graph.overview_data(reports[("toy_inplace", "gather_erase")])
    assert data.range.numerically_unsafe and [e.piece for e in data.erased] == [2, 4]
    assert [e.target for e in data.erased] == ["residual", "residual"]  # the copy_ into the model's residual
    assert "unsafe: copy_ erased" in _all_text(graph.build_overview_figure(data))
    # Out-of-place residuals have no copy_ to erase: the same strategy is safe there.
    safe = graph.overview_data(reports[("toy", "gather_erase")])
    assert not safe.erased and not safe.range.numerically_unsafe
    assert "unsafe" not in _all_text(graph.build_overview_figure(safe))


def test_identical_layers_collapse_and_expand(reports):
    """Two layers are too few to repeat; a report with the middle layer copied five times collapses to a group."""
    plain = reports[("llama", "sharded")].to_dict()
    rng = plain["ranges"][1]
    first, middle_attn, middle, _last_attn, last = rng["pieces"]
    pieces = [first, middle_attn] + [dict(middle), dict(middle_attn)] * 5 + [last]
    pieces = [dict(p, index=i, name=f"submod_{i}") for i, p in enumerate(pieces)]
    rng["pieces"] = pieces
    b0, b1 = rng["boundaries"]
    rng["boundaries"] = [dict(b0 if i == 0 else b1, index=i, after_piece=2 * i, before_piece=2 * i + 2)
                         for i in range(6)]
    data = graph.overview_data(plain, 1)
    (group,) = data.groups
    assert (group.label, group.period) == ("pieces 2-10 x5", 2)
    assert [type(i).__name__ for i in data.lane()] == ["PieceBox", "PieceBox", "PieceGroup", "PieceBox", "PieceBox"]
    covered = [i for item in data.lane() for i in (item.pieces if isinstance(item, graph.PieceGroup) else [item.index])]
    assert covered == [p.index for p in data.pieces]
    assert len(data.lane(expand=True)) == len(data.pieces)
    assert group.label in _all_text(graph.build_overview_figure(data))
    with pytest.raises(ValueError, match="g7"):
        data.lane(expand=["g7"])


def test_range_selection_and_errors(reports):
    report = reports[("toy", "sharded")]
    assert not graph.overview_data(report, 0).range.enable_sp
    assert graph.overview_data(report, -1).range_index == 1
    with pytest.raises(IndexError, match="0: tokens 1-7, 1: tokens 8-64"):
        graph.overview_data(report, 5)
    with pytest.raises(ValueError, match="schema"):
        graph.overview_data({"schema": "something/else", "ranges": [{}]})
    with pytest.raises(FileNotFoundError, match="to_json"):
        graph.load_report("/nonexistent/report.json")


def test_uncompiled_range_is_explained(reports):
    plain = reports[("toy", "sharded")].to_dict()
    plain["ranges"][1].update(pieces=[], boundaries=[], compiled=False, compile_time_s=0.0)
    assert graph.overview_data(plain).range_index == 0  # the range with pieces
    empty = graph.overview_data(plain, 1)
    assert empty.pieces == () and empty.lane() == []
    assert "not compiled yet" in graph.build_overview_figure(empty).layout.title.text
    with pytest.raises(IndexError, match="not compiled"):
        graph.piece_diff_data(plain, 1, 2)


# ------------------------------------------------------------------------------------------ drill-down data

@pytest.mark.parametrize("key", [k for k in ALL if k != ("toy_inplace", "none")], ids=lambda k: "-".join(k))
def test_collapsed_graph_accounts_for_every_node(reports, key):
    report = reports[key]
    for piece in (0, 2, 4):
        diff = graph.piece_diff_data(report, None, piece)
        raw = report.ranges[1].pieces[piece]
        for collapsed, snapshot in ((diff.after, raw.graph_after), (diff.before, raw.graph_before)):
            folded = sum(is_folded(n) for n in snapshot.nodes)
            assert sum(n.count for n in collapsed.nodes) + folded == len(snapshot.nodes)
            ids = {n.id for n in collapsed.nodes}
            assert all(a in ids and b in ids and a != b for a, b in collapsed.edges)
            assert len(collapsed.nodes) < len(snapshot.nodes) / 2  # collapsing is worth it
        # Nothing the passes added is lost from view: every added node not folded sits in a changed box.
        shown = {m for n in diff.after.nodes if n.changed for m in n.members}
        assert {a for a in diff.added if diff.after.node_of(a)} <= shown


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_llama_norms_collapse_into_one_box_with_their_module(reports, strategy):
    diff = graph.piece_diff_data(reports[("llama", strategy)], None, 2)
    norms = [n for n in diff.after.nodes if n.kind == "norm"]
    # RMSNorm: pow, mean, add, rsqrt, mul, mul -- post_attention_layernorm of layer 0 and input_layernorm of 1.
    assert [n.count for n in norms] == [6, 6]
    assert [n.ops[0] for n in norms] == ["pow", "pow"] and [n.ops[-1] for n in norms] == ["mul", "mul"]
    # SP re-creates each norm on the token shard; the new nodes keep the module of the norm they replace.
    assert [n.module for n in norms] == ["model.layers.0.post_attention_layernorm", "model.layers.1.input_layernorm"]
    assert " · layers.0.post_attention_layernorm · " in norms[0].label
    # A fused op the pass inserted is named after its matmul's weight (inferred, marked "~").
    fused = [n for n in diff.after.nodes if n.kind == "fused"]
    assert [n.module.rsplit(".", 1)[-1] for n in fused] == ["o_proj", "gate_up_proj", "down_proj", "qkv_proj"]
    assert all(n.module_inferred and " · ~layers." in n.label for n in fused)
    assert norms[0].label.startswith("pow…mul ×6 · ")
    matmuls = [n for n in diff.before.nodes if n.kind == "matmul"]
    assert [n.module.rsplit(".", 1)[-1] for n in matmuls] == ["o_proj", "gate_up_proj", "down_proj", "qkv_proj"]
    assert all(n.sources and n.sources[0].startswith("layers.py:") for n in matmuls)  # the source line


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("strategy", ["gather_erase", "gather", "sharded"])
def test_diff_regions_account_for_every_rewrite(reports, model, strategy):
    diff = graph.piece_diff_data(reports[(model, strategy)], None, 2)
    counts = {r["op"]: r for r in diff.op_counts.iter_rows(named=True)}
    fused = [r for r in diff.regions if "AsyncTP" in r.title]
    # Every fused op sits in a region titled with it.
    for key, short in (("fused_all_gather_matmul", "AG+mm"), ("fused_matmul_reduce_scatter", "mm+RS")):
        in_regions = [a for r in fused for a in r.added if key in a]
        assert len(in_regions) == counts[key]["after"] == 2
        assert all(short in r.title for r in fused if any(key in a for a in r.added))
    for region in diff.regions:
        assert set(region.removed) <= set(diff.removed) and set(region.added) <= set(diff.added)
        assert any(n.changed for n in (*region.before.nodes, *region.after.nodes))
    if strategy == "sharded":
        # SP ran on the whole graph before the split: the piece's own pass only fused (AsyncTP).
        assert all(r.title.startswith("AsyncTP:") for r in fused)
        assert counts["all_reduce"]["before"] == 0
    else:
        # In-piece SP: each all_reduce of o_proj / down_proj became a reduce_scatter fused into its matmul.
        assert counts["all_reduce"]["before"] == 2 and counts["all_reduce"]["after"] == 0
        mm_rs = [r for r in fused if "mm+RS" in r.title]
        assert all(r.title.split("→")[0].split(":")[1].strip().startswith("1 AR, ") for r in mm_rs)
        assert [r.module.rsplit(".", 1)[-1] for r in mm_rs] == ["o_proj", "down_proj"]


def test_search_by_op_and_module(reports):
    diff = graph.piece_diff_data(reports[("llama", "gather")], None, 2)
    fused = diff.after.search("mm+RS")
    assert len(fused) == 2 and all(diff.after.node_of(i) == i for i in fused)
    mlp = diff.after.search("MLP")
    assert mlp and all("mlp" in (n.module or "") for n in diff.after.nodes if n.id in mlp)
    assert diff.after.search("") == () and diff.after.search("no such op") == ()
    fig = graph.build_piece_figure(diff, "after", search="mm+RS")
    (found,) = [t for t in fig.data if t.name == "search match"]
    assert sum(x is None for x in found.x) == 2  # two outlined boxes


def test_tensor_links_find_producers_and_consumers(reports):
    report = reports[("llama", "gather")]
    data = graph.overview_data(report)
    residual = next(i for i, t in enumerate(data.boundaries[0].tensors) if t.name == "residual")
    links = graph.tensor_links(report, None, 0, residual)
    assert links.exact and links.tensor == "residual"  # the report says which output and which inputs
    (producer,) = links.producers
    assert producer.piece == 0 and producer.shape == data.boundaries[0].tensors[residual].shape_after
    assert links.consumers and {c.piece for c in links.consumers} == {2}
    # positions is made in piece 0 by the root module (torch.arange) and read by the rotary embedding.
    positions = next(i for i, t in enumerate(data.boundaries[0].tensors) if t.name == "positions")
    made = graph.tensor_links(report, None, 0, positions)
    assert [p.piece for p in made.producers] == [0] and made.consumers
    assert all("rotary_emb" in (c.module or "") for c in made.consumers)
    with pytest.raises(IndexError, match="boundaries"):
        graph.tensor_links(report, None, 7, 0)


# ------------------------------------------------------------------------------------------ layout

def test_dot_layout_is_layered_top_to_bottom(reports):
    diff = graph.piece_diff_data(reports[("llama", "sharded")], None, 2)
    nodes = tuple((n.id, n.label) for n in diff.after.nodes)
    layout = graph.dot_layout(nodes, diff.after.edges)
    pos = {p.id: p for p in layout.nodes}
    assert set(pos) == {n.id for n in diff.after.nodes}
    assert all(pos[a].y > pos[b].y for a, b in diff.after.edges)  # every edge points down
    assert len(layout.edges) == len(diff.after.edges) and all(len(line) >= 2 for _, _, line in layout.edges)
    # Boxes on one rank do not overlap.
    by_rank: dict = {}
    for p in layout.nodes:
        by_rank.setdefault(round(p.y), []).append(p)
    for row in by_rank.values():
        row.sort(key=lambda p: p.x)
        assert all(a.x + a.width / 2 <= b.x - b.width / 2 + 0.5 for a, b in itertools.pairwise(row))


def test_missing_dot_names_the_fix(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(dag_layout.GraphvizMissing, match="apt-get install graphviz"):
        graph.dot_layout((("never-laid-out-before", "x"),), ())


# ------------------------------------------------------------------------------------------ rendering (smoke)

@pytest.mark.parametrize("mode", ["after", "before", "diff"])
def test_piece_figure_renders_each_mode(reports, mode):
    diff = graph.piece_diff_data(reports[("toy", "gather")], None, 2)
    fig = graph.build_piece_figure(diff, mode)
    labels = next(t for t in fig.data if t.meta == "nodes").text
    assert any("AG+mm (fused)" in s for s in labels) == (mode != "before")
    if mode == "diff":
        assert {a["text"].split("</b>")[0] for a in fig.layout.annotations} >= {f"<b>{r.index + 1}. {r.title}"
                                                                               for r in diff.regions}
    with pytest.raises(ValueError, match="mode="):
        graph.build_piece_figure(diff, "sideways")


def test_splitting_op_piece_has_no_changes(reports):
    diff = graph.piece_diff_data(reports[("toy", "sharded")], None, 1)
    assert diff.piece.kind == "splitting_op" and not diff.added and not diff.removed and diff.regions == ()
    assert "did not change" in str(graph.build_piece_figure(diff, "diff").layout.annotations[0].text)
    with pytest.raises(IndexError, match="piece_index=99"):
        graph.piece_diff_data(reports[("toy", "sharded")], None, 99)


# ------------------------------------------------------------------------------------------ compare and tables

def test_compare_gather_vs_sharded(reports):
    frame = graph.compare_data(reports[("llama", "gather")], reports[("llama", "sharded")])
    row = {r["metric"]: r for r in frame.iter_rows(named=True)}
    assert row["boundary bytes/token"]["b"] < row["boundary bytes/token"]["a"]
    assert row["all_gather/layer"]["b"] < row["all_gather/layer"]["a"]
    assert row["sharded tensors at boundaries"]["a"] == 0 and row["sharded tensors at boundaries"]["b"] == 2
    assert frame["label_a"][0] == "llama-3-8b gather tokens 8-64"
    fig = graph.plot_compare(reports[("llama", "gather")], reports[("llama", "sharded")])
    assert sum(isinstance(t, go.Bar) for t in fig.data) == 2 * 4
    # At a notebook's width four panels get about 200 px each: their titles on short lines (a long one ran into its
    # neighbours), the collectives abbreviated as the overview's key writes them, the legend at the bottom edge.
    panel_titles = [a.text for a in fig.layout.annotations]
    assert len(panel_titles) == 4 and all(len(line) <= 22 for t in panel_titles for line in t.split("<br>"))
    ticks = {x for t in fig.data for x in t.x}
    assert {"AG+mm/layer", "mm+RS/layer"} <= ticks and not any("fused_" in x for x in ticks)
    assert (fig.layout.legend.yref, fig.layout.legend.y) == ("container", 0)


def test_every_explorer_figure_says_where_its_report_was_compiled(reports):
    """Overview, drill-down (every mode) and compare name backend, device and torch; a fake process group's report
    (the fixtures', notebook 2's) says "fake process group: graphs only": its compile times are one process's."""
    fake = reports[("llama", "sharded")]
    line = "fake process group: graphs only · device cpu · torch " + fake.provenance["torch"]
    assert graph.report_provenance(fake) == line
    assert graph.plot_overview(fake).layout.title.text.endswith(f"<br><sup>{line}</sup>")
    for mode in ("after", "before", "diff"):
        title = graph.plot_piece(fake, 2, mode=mode).layout.title.text
        assert title.startswith("submod_2 ") and title.endswith(f"<br><sup>{line}</sup>"), mode
    assert graph.plot_piece(fake, 1, mode="diff").layout.title.text.endswith(f"{line}</sup>")  # "no rewritten regions" too
    assert graph.plot_compare(reports[("llama", "gather")], fake).layout.title.text.endswith(f"<sup>{line}</sup>")
    real = fake.to_dict()
    real["provenance"] = dict(real["provenance"], backend="nccl", device="NVIDIA H200", torch="2.9.0+cu128")
    assert graph.report_provenance(graph.as_report(real)) == "backend nccl · device NVIDIA H200 · torch 2.9.0+cu128"
    assert "graphs only" not in graph.plot_overview(real).layout.title.text
    both = graph.plot_compare(fake, real, labels=("fake", "real")).layout.title.text
    assert both == f"a: fake <sup>({line})</sup><br>b: real <sup>(backend nccl · device NVIDIA H200 · torch 2.9.0+cu128)</sup>"


def test_tables(reports):
    report = reports[("llama", "gather")]
    table = graph.piece_table(report)
    assert table.height == sum(len(r.pieces) for r in report.ranges) == 10
    assert table.filter(pl.col("range") == 1)["match_sp_middle"].sum() + table["match_sp_first"].sum() > 0
    ranges = graph.range_table(reports[("toy_inplace", "gather_erase")])
    assert ranges["numerically_unsafe"].to_list() == [False, True]
    assert graph.range_table(reports[("toy_inplace", "none")])["compiled"].to_list() == [True, False]


def test_the_notebooks_tables_are_shown_whole_at_its_width(reports):
    """What notebook 1 shows: op counts by token count and the passes' matches per piece. polars cut them at the
    right (column names such as fused_matmul_reduce_scatter); compact() names columns as the figures abbreviate
    them and rounds floats, and show_whole_tables() has polars print every row and column."""
    from sp_lab.viz.tables import NOTEBOOK_CHARS, compact

    def width(table: pl.DataFrame) -> int:
        return max(len(line) for line in str(table).splitlines())

    report = reports[("llama", "gather")]
    ops = pl.DataFrame([{"num_tokens": t, **report.op_counts(t), "sp_rewrites": report.sp_rewrites(t),
                         "fusion_fired": report.fusion_fired(t)} for t in (5, 12, 64)])
    matches = graph.piece_table(report).select("range", "piece", "kind", "op", "match_sp_first", "match_sp_middle",
                                               "match_sp_last", "match_async_tp_ag_mm", "match_async_tp_mm_rs",
                                               "compile_time_s")
    with pl.Config():  # restores polars' settings afterwards
        graph.show_whole_tables()
        for table in (ops, matches):
            shown = compact(table)
            assert width(table) > NOTEBOOK_CHARS >= width(shown), (width(table), width(shown))
            assert shown.height == table.height and shown.width == table.width and "…" not in str(shown)
        assert compact(ops).columns == ["tokens", "AR", "RS", "AG", "AG+mm", "mm+RS", "mm", "SP rewrites", "fused"]
        assert compact(matches)["compile s"].to_list() == matches["compile_time_s"].round(2).to_list()
        wide = pl.DataFrame({f"column_{i}": range(40) for i in range(20)})
        assert "…" not in str(wide) and str(wide).count("\n") > 40  # every row and column


# ------------------------------------------------------------------------------------------ export

def test_save_html_writes_all_figures(tmp_path, reports):
    report = reports[("toy", "none")]
    path = graph.save_html([graph.plot_overview(report), graph.plot_piece(report, 2)], tmp_path / "out" / "r.html")
    html = path.read_text()
    assert html.count("Plotly.newPlot") == 2 and len(html) > 1_000_000  # plotly.js embedded: opens offline
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

    handler = _Capture()
    # Only our handler: torch's LazyTraceHandler removes itself on its first record when TORCH_TRACE is unset.
    monkeypatch.setattr(trace_log, "handlers", [handler])
    assert graph.emit_trace(_path("toy", "sharded"))
    names = [r.metadata["artifact"]["name"] for r in handler.records]
    assert names == ["sp_lab_compile_report", "sp_lab_overview_0", "sp_lab_overview_1"]
    # The report as the one loader reads it (a schema-1 file arrives migrated to the current schema).
    assert json.loads(handler.records[0].payload) == CompileReport.load(_path("toy", "sharded")).to_dict()
    assert len(json.loads(handler.records[2].payload)["pieces"]) == 5


def test_emit_trace_warns_on_incompatible_torch(monkeypatch, reports):
    import torch._logging

    monkeypatch.setattr(torch._logging, "trace_structured", lambda name, payload: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert graph.emit_trace(reports[("toy", "sharded")]) is False
    assert any("metadata_fn" in str(w.message) for w in caught)


# ------------------------------------------------------------------------------------------ widget

def test_explorer_widget_click_through(reports):
    from sp_lab.widgets.explorer import explore

    def click(key: str) -> None:
        """A click on the overview item ``key``, as the browser sends it: the message of the overview's view."""
        fig = ex.overview_figure
        (trace,) = [i for i, t in enumerate(fig.data) if t.customdata is not None and key in list(t.customdata)]
        index = list(fig.data[trace].customdata).index(key)
        ex.overview_view._on_front_end_message(ex.overview_view, {"event": "click", "points": [
            {"curve": trace, "index": index, "customdata": key}]}, [])

    ex = explore(_path("llama", "gather"))
    assert ex.piece_select.value == 0 and ex.piece_figure.layout.title.text.startswith("submod_0")
    click("piece:4")
    assert ex.piece_select.value == 4 and ex.piece_figure.layout.title.text.startswith("submod_4")
    # A click on a boundary tensor (the residual crossing boundary 0) lists its producers and consumers.
    assert ex.links is None
    click("tensor:0:3")
    assert ex.links is not None and ex.links.tensor == "residual" and ex.links.boundary == 0
    assert ex.links.producers and "produced by" in ex.links_view.value
    click("piece:1")  # the attention op: nothing to open, said so
    assert "eagerly" in ex.links_view.value and ex.piece_select.value == 4
    ex.mode_select.value = "after"
    ex.search.value = "mlp"
    assert any(t.name == "search match" for t in ex.piece_figure.data)
    ex.range_select.value = 0
    assert ex.data.range_index == 0 and not ex.data.range.enable_sp and ex.links is None
    failed = explore(_path("toy_inplace", "none"))
    assert failed.piece_figure is None and "compile failed" in failed.overview_figure.layout.title.text


def test_shapes_read_in_the_models_terms_and_abbreviations_have_a_key(reports):
    """The compiler's symbols (s37, ((s37 + 1)//2)) are shown as N and ceil(N/2) wherever a shape is printed,
    and every figure that abbreviates (RS, AG+mm, B/tok) carries the key to them."""
    import re

    report = reports[("llama", "sharded")]
    data = graph.overview_data(report)
    overview = graph.build_overview_figure(data)
    texts = _all_text(overview)
    assert "ceil(N/2)" in texts  # the residual crosses sharded: [ceil(N/tp), H] at tp 2
    assert not re.search(r"\bs\d+\b", texts), "a compiler symbol is shown raw"
    piece = graph.build_piece_figure(graph.piece_diff_data(report, None, 2), "after")
    assert not re.search(r"\bs\d+\b", _all_text(piece))
    for fig in (overview, piece):
        (key,) = [a.text for a in fig.layout.annotations if "B/tok = bytes per token" in a.text]
        assert "RS = reduce-scatter" in key and "AG+mm = all-gather fused" in key and "N = tokens" in key
