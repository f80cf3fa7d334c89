"""What the compiler writes into the CompileReport: records filled by the passes, the model's names for
boundary tensors in every strategy, one Dynamo capture per model, and failures translated only when verified.

Compiles are inspect-only (meta-device models under the fake group: capture, split and every pass run as in
a real compile, no code generation), so the whole file costs about 12 small compiles, shared by module
fixtures.
"""

from __future__ import annotations

import dataclasses
import gc
import operator
import shutil
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import sympy
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import sp_lab
from sp_lab.compiler import capture, inspection
from sp_lab.compiler.failures import BoundaryError, copy_epilogue_failure, explain, guard_inputs
from sp_lab.compiler.passes import post_grad
from sp_lab.compiler.passes.sequence_parallel import padded_shard_rows
from sp_lab.compiler.ranges import CompileRange
from sp_lab.compiler.report import (
    BoundaryFailure,
    CompileReport,
    CopyEvent,
    FusionDecision,
    PieceRecord,
    RangeReport,
    SPRewrite,
    TensorSpec,
    record_from_json,
    record_to_json,
)
from sp_lab.distributed.collectives import fake_process_group

TP = 2
STRATEGIES = ("none", "gather_erase", "gather", "sharded")
LLAMA_MINI = {"num_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2,
              "vocab_size": 256}
MODELS = {  # label -> (preset, overrides)
    "toy": ("toy", {}),
    "toy_inplace": ("toy", {"residual_inplace": True}),
    "llama": ("llama-3-8b", LLAMA_MINI),
}


def _config(boundary: str) -> sp_lab.LabConfig:
    return sp_lab.LabConfig(tp_size=TP, async_tp_min_tokens=8, max_num_tokens=64, boundary=boundary)


@pytest.fixture(scope="module")
def reports() -> dict[tuple[str, str], CompileReport]:
    """Every model under every strategy, inspect-only at 12 tokens: one capture per model, shared by its
    strategies."""
    out = {}
    with fake_process_group(TP):
        for label, (preset, overrides) in MODELS.items():
            torch._dynamo.reset()
            model = sp_lab.models.build(preset, tp_rank=0, tp_size=TP, device="meta", **overrides)
            shared = capture.SharedCaptures(model)
            for boundary in STRATEGIES:
                compiled = sp_lab.compile(model, _config(boundary), captures=shared)
                compiled(torch.arange(12, device="meta"))
                out[label, boundary] = compiled.report
    torch._dynamo.reset()
    return out


# -- boundary names ------------------------------------------------------------------------------------------------


def _names(report: CompileReport) -> list[list[str]]:
    return [[t.name for t in b.tensors] for b in report.range_for(12).boundaries]


@pytest.mark.parametrize("label", list(MODELS))
def test_boundary_tensors_carry_the_models_names_in_every_strategy(reports, label):
    by_strategy = {b: _names(reports[label, b]) for b in STRATEGIES}
    first = by_strategy["gather"]
    assert len(first) == 2  # two layers: two attention boundaries
    assert set(first[0]) == {"q", "k", "v", "residual", "positions"}, first
    assert all("residual" in names for names in first)
    assert not any(name.startswith(("getitem", "add", "wait_tensor")) for names in first for name in names)
    for boundary, names in by_strategy.items():  # the same names, whichever way the boundary is handed over
        assert [sorted(n) for n in names] == [sorted(n) for n in first], (boundary, names)


@pytest.mark.parametrize("label", list(MODELS))
def test_boundary_tensors_name_their_module_and_source_line(reports, label):
    where = {}
    for boundary in STRATEGIES:
        for b in reports[label, boundary].range_for(12).boundaries:
            for t in b.tensors:
                where.setdefault((b.index, t.name), set()).add((t.module, t.source))
    assert all(len(places) == 1 for places in where.values()), where  # identical in every strategy
    (module, source), = where[0, "residual"]
    assert module == "model.embed_tokens" and source.startswith("layers.py:")
    (module, source), = where[0, "q"]
    assert module == "model.layers.0.self_attn.rotary_emb"
    (module, source), = where[0, "positions"]
    assert module is None and "positions = torch.arange" in source  # made by the root module
    residual_1 = where[1, "residual"]
    expected = "model.embed_tokens" if label == "toy_inplace" else "model.layers.1.input_layernorm"
    assert {m for m, _ in residual_1} == {expected}  # in place, layer 1 updates the embedding's buffer


def test_boundary_tensors_say_which_pieces_make_and_use_them(reports):
    for (label, boundary), report in reports.items():
        rng = report.range_for(12)
        assert len(rng.boundaries) == 2, (label, boundary)  # one per attention of the 2-layer models
        for b in rng.boundaries:
            split = b.after_piece + 1  # the splitting op's piece
            for t in b.tensors:
                producer = rng.pieces[t.producer_piece]
                assert t.producer_piece < split and producer.kind == "compiled"
                assert producer.outputs[t.producer_output].shape == t.shape_after, (label, boundary, t)
                assert t.consumer_inputs and all(piece >= split for piece, _ in t.consumer_inputs)
                for piece, i in t.consumer_inputs:
                    consumer = rng.pieces[piece]
                    if consumer.kind == "compiled" and boundary != "none":  # none: the known mismatch
                        assert consumer.inputs[i].shape == t.shape_after, (label, boundary, t.name)


def test_piece_inputs_and_copies_take_the_models_names_in_every_strategy(reports):
    """A piece's inputs that cross a boundary, and the epilogue ``copy_`` into the in-place residual, carry the
    name the boundary table gives them (the failure message and the explorer read them there), not the graph's
    own (Dynamo's ``hidden``, AOT's ``arg3_1``)."""
    for (label, boundary), report in reports.items():
        rng = report.range_for(12)
        crossing = 0
        for b in rng.boundaries:
            for t in b.tensors:
                for piece, i in t.consumer_inputs:
                    if piece == b.before_piece:
                        crossing += 1
                        assert rng.pieces[piece].inputs[i].name == t.name, (label, boundary, piece, i, t.name)
        assert crossing >= 3, (label, boundary)  # the residual and positions into piece 2, the residual into 4
        targets = [c.target for p in rng.pieces for c in p.copies]
        if label == "toy_inplace" and boundary != "sharded":  # sharded: the residual never leaves as a copy
            assert targets == ["residual", "residual"], (boundary, targets)


def test_a_boundary_error_writes_shapes_as_the_tables_do():
    failure = BoundaryFailure(2, "residual", "copy_epilogue", ("s37", 256), ("((s37 + 1)//2)", 256),
                              "expand: attempting to expand a dimension of length ((s37 + 1)//2) -> s37!", 1, 64)
    message = explain(failure, "none")
    assert "sharded tensor 'residual' at piece 2" in message
    assert "expected shape [N, 256], got [ceil(N/2), 256]" in message, message
    assert message.endswith("expand a dimension of length ceil(N/2) -> N!"), message
    assert "s37" not in message


def test_sharded_boundaries_carry_the_residual_as_a_shard(reports):
    for label in MODELS:
        boundaries = reports[label, "sharded"].range_for(12).boundaries
        assert len(boundaries) == 2, label
        for b in boundaries:
            sharded = {t.name for t in b.tensors if t.sharded_after}
            assert sharded == {"residual"}, (label, b.index, sharded)



def test_a_padded_fp8_shard_is_recorded_with_the_calls_rows():
    """Row-wise FP8 shards hold a multiple of 4 rows (3 tokens at tp 2: 4 rows, zero-padded): the boundary record
    still knows the residual for a shard, what it is unsharded and what it costs per token of the call."""
    with fake_process_group(TP):
        torch._dynamo.reset()
        model = sp_lab.models.build("toy", tp_rank=0, tp_size=TP, device="meta", quant="fp8", dtype=torch.bfloat16)
        compiled = sp_lab.compile(model, dataclasses.replace(_config("sharded"), async_tp_min_tokens=2))
        compiled(torch.arange(3, device="meta"))
    torch._dynamo.reset()
    hidden = model.spec.hidden_size
    residuals = [t for b in compiled.report.range_for(3).boundaries for t in b.tensors if t.name == "residual"]
    assert residuals and all(t.sharded_after for t in residuals)
    for t in residuals:
        assert t.shape_after[0] != t.shape_before[0] and t.shape_before[1:] == t.shape_after[1:] == (hidden,)
        assert t.bytes_per_token_after == hidden * 2 / TP  # bf16 rows, one tp-th of them per rank
        # The size the pass built into the graph is padded_shard_rows (the records' one formula) at every count.
        rows = sympy.sympify(t.shape_after[0])
        (n,) = rows.free_symbols
        assert [int(rows.subs(n, count)) for count in range(1, 40)] == [
            padded_shard_rows(count, TP, 4) for count in range(1, 40)]


# -- records the passes fill ------------------------------------------------------------------------------------


def test_passes_fill_typed_records(reports):
    rng = reports["toy_inplace", "gather_erase"].range_for(12)
    compiled = [p for p in rng.pieces if p.kind == "compiled"]
    assert all(isinstance(p, PieceRecord) for p in rng.pieces)
    rewrites = [r for p in compiled for r in p.sp_rewrites]
    assert rewrites and all(isinstance(r, SPRewrite) for r in rewrites)
    assert sum(p.matches.get("sp_first", 0) + p.matches.get("sp_middle", 0) + p.matches.get("sp_last", 0)
               for p in compiled) == len(rewrites)
    decisions = [d for p in compiled for d in p.async_tp_decisions]
    assert decisions and all(isinstance(d, FusionDecision) and d.m == 8 for d in decisions)  # judged at lo
    assert sum(d.decision == "fuse" for d in decisions) == sum(
        p.op_counts_after["fused_all_gather_matmul"] + p.op_counts_after["fused_matmul_reduce_scatter"]
        for p in compiled)
    erased = [c for p in compiled for c in p.copies]
    assert erased and all(isinstance(c, CopyEvent) and c.action == "erased" for c in erased)
    assert rng.numerically_unsafe
    gathered = [c for p in reports["toy_inplace", "gather"].range_for(12).pieces for c in p.copies]
    assert gathered and {c.action for c in gathered} == {"gathered"}
    assert all(isinstance(s, TensorSpec) for s in compiled[0].inputs)
    mms = [n for n in compiled[0].graph_before.nodes if n.kind == "matmul"]
    assert mms and all(n.module and n.module.startswith("model.") and n.source.startswith(("layers.py:", "llama.py:"))
                       for n in mms)


def test_the_side_file_stores_the_same_record(reports):
    """The record kept beside Inductor's cache is the report's own record, written with the report's encoder."""
    for piece in reports["llama", "sharded"].range_for(12).pieces:
        assert record_from_json(PieceRecord, record_to_json(piece)) == piece


def test_recorded_counts_are_keyed_by_the_code_that_counts(tmp_path, monkeypatch):
    sp_pass = post_grad.PostGradPassManager(
        post_grad.sp_lab_passes(tp_size=2, rank=0, group_name="g", boundary="gather", m_low=8, use_symm_mem=False),
        CompileRange(8, 64, enable_sp=True, enable_async_tp=True), "g")
    before = sp_pass.uuid()
    changed = tmp_path / "inspection.py"
    shutil.copy(inspection.__file__, changed)
    changed.write_text(changed.read_text() + "\n# counting changed\n")
    sources = [changed if p == Path(inspection.__file__) else p for p in post_grad._RECORD_SOURCES]
    assert sources != post_grad._RECORD_SOURCES  # inspection.py is part of the key
    monkeypatch.setattr(post_grad, "_RECORD_SOURCES", sources)
    assert sp_pass.uuid() != before



def test_the_fingerprint_tells_apart_what_pieces_compute_and_not_which_weights_they_read():
    """Identical pieces share one compiled artifact (and one side file) by their fingerprint: two graphs that
    call different methods, or different functions of one name, or hold different constants, must not."""
    x = [torch.randn(4, 8)]

    def fingerprint(fn) -> str:
        return inspection.structural_fingerprint(torch.fx.symbolic_trace(fn), x)

    assert fingerprint(lambda t: t.float().sum(-1)) != fingerprint(lambda t: t.float().mean(-1))
    assert fingerprint(lambda t: operator.mul(t, 2)) != fingerprint(lambda t: torch.mul(t, 2))  # same __name__

    class Scaled(torch.nn.Module):
        def __init__(self, scale: float):
            super().__init__()
            self.register_buffer("scale", torch.tensor(scale))

        def forward(self, t, w):
            return torch.nn.functional.linear(t, w) * self.scale

    one, two = (torch.fx.symbolic_trace(Scaled(s)) for s in (1.0, 2.0))
    weights = [x[0], torch.randn(3, 8)]
    assert inspection.structural_fingerprint(one, weights) != inspection.structural_fingerprint(two, weights)
    # Weights are inputs: other values, one fingerprint (every decoder layer's piece).
    assert (inspection.structural_fingerprint(one, weights)
            == inspection.structural_fingerprint(one, [torch.randn(4, 8), torch.randn(3, 8)]))


# -- one Dynamo capture per model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_capture() -> tuple[CompileReport, float, int]:
    """The toy at 1, 5, 12 and 6 tokens; then Dynamo's caches dropped and 3 and 20 tokens asked."""
    with fake_process_group(TP):
        torch._dynamo.reset()
        model = sp_lab.models.build("toy", tp_rank=0, tp_size=TP, device="meta")
        compiled = sp_lab.compile(model, _config("gather"))
        captures = capture.counters["captures"]
        start = time.perf_counter()
        for n in (1, 5, 12, 6):  # 1 token included: the capture's token count is symbolic from the first call
            compiled(torch.arange(n, device="meta"))
        wall = time.perf_counter() - start
        # Calls never go through Dynamo again: with its caches gone, a call that did would be traced afresh.
        torch._dynamo.reset()
        for n in (3, 20):
            compiled(torch.arange(n, device="meta"))
        captures = capture.counters["captures"] - captures
    torch._dynamo.reset()
    return compiled.report, wall, captures


def test_one_dynamo_capture_serves_every_token_count(one_capture):
    report, _, captures = one_capture
    assert captures == 1
    assert [(g.index, g.static_tokens) for g in report.graphs] == [(0, None)]
    entries = [(r.lo, r.hi, r.dynamo_graph, r.static_tokens, r.compiled) for r in report.ranges]
    assert entries == [(1, 7, 0, None, True), (8, 64, 0, None, True)]
    assert report.range_for(1) is report.range_for(5)
    assert all(r.compile_time_s > 0 for r in report.ranges)
    again = CompileReport.from_json(report.to_json())
    assert again.to_dict() == report.to_dict()


def test_an_unhashable_argument_picks_its_capture_by_identity_and_stays_alive():
    """Dynamo specialises on a non-tensor argument; the call signature must tell two such objects apart even when
    they cannot be hashed, and no other object may take a kept one's id (the signature holds it)."""

    class Opaque:
        __hash__ = None  # type: ignore[assignment]

    tokens, kept = torch.arange(4), Opaque()
    signature = capture.call_signature(tokens, 0, (kept,), {})
    assert signature == capture.call_signature(tokens, 0, (kept,), {})
    assert signature != capture.call_signature(tokens, 0, (Opaque(),), {})
    alive = weakref.ref(kept)
    del kept
    gc.collect()
    assert alive() is not None


def test_compile_times_add_up_to_what_the_first_calls_cost(one_capture):
    report, wall, _ = one_capture
    assert all(g.capture_time_s > 0 for g in report.graphs)
    # Captures + range compiles == the calls' wall time, less only the (meta-device) forwards themselves.
    assert 0.9 * wall <= report.compile_time_s <= wall, (report.compile_time_s, wall)


def test_dynamo_recompile_limit_is_left_alone(one_capture):
    assert torch._dynamo.config.recompile_limit == 8


# -- one capture for every variant of a model --------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_capture() -> dict[str, Any]:
    """One toy compiled three ways with shared captures, each called at 12 and 3 tokens; a fourth compile with
    another token dimension."""
    with fake_process_group(TP):
        torch._dynamo.reset()
        model = sp_lab.models.build("toy", tp_rank=0, tp_size=TP, device="meta")
        shared = capture.SharedCaptures(model)
        before = capture.counters["captures"]
        variants = {
            "gather": sp_lab.compile(model, _config("gather"), captures=shared),
            "sharded": sp_lab.compile(model, _config("sharded"), captures=shared),
            "no_async_tp": sp_lab.compile(model, dataclasses.replace(_config("sharded"), enable_async_tp=False),
                                          captures=shared),
        }
        for compiled in variants.values():
            for n in (12, 3):
                compiled(torch.arange(n, device="meta"))
        captured = capture.counters["captures"] - before
        with pytest.raises(ValueError) as other:
            sp_lab.compile(sp_lab.models.build("toy", tp_rank=0, tp_size=TP, device="meta"), _config("gather"),
                           captures=shared)
    out = {"reports": {v: c.report for v, c in variants.items()}, "captures": captured,
           "other_model": str(other.value)}
    # A plain layer with an all_reduce: under another group, or called with another batch, it is captured anew.
    layer = _AllReduced()
    shared = capture.SharedCaptures(layer)
    before = capture.counters["captures"]
    for tp, token_dim, shape in ((2, 0, (12, 8)), (4, 0, (12, 8)), (2, 1, (2, 12, 8)), (2, 0, (20, 8))):
        with fake_process_group(tp):
            config = sp_lab.LabConfig(tp_size=tp, async_tp_min_tokens=8, max_num_tokens=64, token_dim=token_dim)
            sp_lab.compile(layer, config, captures=shared, inspect_only=True)(torch.randn(shape))
    out["layer_captures"], out["layer_kept"] = capture.counters["captures"] - before, len(shared)
    torch._dynamo.reset()
    return out


def test_a_capture_whose_first_range_fails_to_compile_still_serves_the_other_variants(monkeypatch):
    from sp_lab.compiler.range_compiler import RangeCompiler

    layer = _AllReduced()
    shared = capture.SharedCaptures(layer)
    config = sp_lab.LabConfig(tp_size=TP, async_tp_min_tokens=8, max_num_tokens=64)
    compile_range = RangeCompiler.compile

    def fails(self):
        raise RuntimeError("this config's range does not compile")

    before = capture.counters["captures"]
    with fake_process_group(TP):
        monkeypatch.setattr(RangeCompiler, "compile", fails)
        with pytest.raises(RuntimeError, match="does not compile"):
            sp_lab.compile(layer, config, captures=shared, inspect_only=True)(torch.randn(12, 8))
        monkeypatch.setattr(RangeCompiler, "compile", compile_range)
        other = sp_lab.compile(layer, dataclasses.replace(config, boundary="sharded"), captures=shared,
                               inspect_only=True)
        other(torch.randn(12, 8))
    torch._dynamo.reset()
    assert capture.counters["captures"] - before == 1
    assert [g.shared_capture for g in other.report.graphs] == [True] and other.report.range_for(12).compiled


class _AllReduced(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(torch.nn.functional.linear(x, self.weight), "sum", dist.group.WORLD)


def test_variants_of_one_model_share_one_capture(shared_capture):
    assert shared_capture["captures"] == 1
    reports = shared_capture["reports"]
    assert [g.shared_capture for g in reports["gather"].graphs] == [False]
    assert reports["gather"].graphs[0].capture_time_s > 0
    for variant in ("sharded", "no_async_tp"):  # Dynamo's time is counted once, by the variant that captured
        assert [(g.shared_capture, g.capture_time_s) for g in reports[variant].graphs] == [(True, 0.0)]
    again = CompileReport.from_json(reports["sharded"].to_json())
    assert again.to_dict() == reports["sharded"].to_dict()


def test_each_variant_compiles_its_own_ranges_from_the_shared_graph(shared_capture):
    reports = shared_capture["reports"]
    for report in reports.values():  # both ranges compiled by each variant itself: the route reached its dispatch
        assert [(r.lo, r.hi, r.compiled) for r in report.ranges] == [(1, 7, True), (8, 64, True)]
    fused = {v: sum(r.op_counts().get("fused_matmul_reduce_scatter", 0) for r in report.ranges)
             for v, report in reports.items()}
    assert fused["gather"] > 0 and fused["sharded"] > 0 and fused["no_async_tp"] == 0, fused
    # The boundary differs (gather vs sharded), so do the shapes crossing it: each ran its own passes.
    crossing = {v: [[t.sharded_after for t in b.tensors] for b in report.range_for(12).boundaries]
                for v, report in reports.items()}
    assert crossing["gather"] != crossing["sharded"], crossing


def test_a_shared_capture_serves_only_its_model_group_and_call_signature(shared_capture):
    # tp 2, tp 4 (another group), a batch of 2 (another signature), then 20 tokens (the first capture again).
    assert shared_capture["layer_captures"] == 3 and shared_capture["layer_kept"] == 3
    assert "SharedCaptures of another model" in shared_capture["other_model"]
    assert "captures=None" in shared_capture["other_model"]


# -- failures translated only when verified ----------------------------------------------------------------------


def _kept_copy_record() -> PieceRecord:
    kept = CopyEvent("arg1_1", ("s0", 64), ("((s0 + 1)//2)", 64), "kept")
    return PieceRecord(2, "submod_2", "compiled", copies=(kept,))


def test_a_failed_kept_copy_is_a_boundary_failure():
    error = RuntimeError("expand: attempting to expand a dimension of length ((s0 + 1)//2) -> s0!")
    failure = copy_epilogue_failure(error, _kept_copy_record())
    assert failure is not None and (failure.piece, failure.tensor, failure.check) == (2, "arg1_1", "copy_epilogue")


@pytest.mark.parametrize("message", [
    "CUDA out of memory",  # unrelated
    "expand: attempting to expand a dimension of length 3 -> 7!",  # an expand, but not of the kept copy
])
def test_other_errors_in_a_piece_with_a_kept_copy_are_not_relabelled(message):
    assert copy_epilogue_failure(RuntimeError(message), _kept_copy_record()) is None


def test_an_assertion_outside_inductors_code_passes_through():
    def piece(*args: Any) -> Any:
        raise AssertionError("expected size 6==12, stride 64==64 at dim=0")  # right text, wrong place

    record = dataclasses.replace(_kept_copy_record(), inputs=(TensorSpec("arg1_1", ("s0", 64), "float32"),))
    report = RangeReport(8, 64, True, True, "none", "piecewise")
    with pytest.raises(AssertionError):
        guard_inputs(piece, lambda: record, report)(torch.empty(6, 64))
    assert report.failures == []
    assert not issubclass(AssertionError, BoundaryError)


# -- Inductor's FX-graph cache: the pass's record is replayed, never made up ------------------------------------


class _TwoNorms(torch.nn.Module):
    """``x [T, 16] -> linear -> all_reduce -> RMSNorm`` twice: one piece, two SP sites, AsyncTP candidates."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(16, 16, generator=g)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        for w in self.weights:
            y = funcol.all_reduce(torch.nn.functional.linear(x, w), "sum", dist.group.WORLD)
            x = torch.nn.functional.rms_norm(y, (16,), eps=1e-6)
        return x


def test_an_inductor_cache_hit_replays_the_pass_record(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # cold, and ours alone
    monkeypatch.setenv("SP_LAB_CACHE_DIR", str(tmp_path / "sp_lab"))  # where the records are kept
    records = []
    with fake_process_group(TP):
        for attempt in range(3):
            if attempt == 2:  # the side file lost: the piece compiles again with the cache off
                for side_file in (tmp_path / "sp_lab" / "sp_lab_piece_records").glob("*.json"):
                    side_file.unlink()
            torch._dynamo.reset()
            compiled = sp_lab.compile(_TwoNorms(), _config("gather"))
            compiled(torch.randn(12, 16))
            (piece,) = compiled.report.range_for(12).pieces
            records.append(piece)
    torch._dynamo.reset()
    assert [p.inductor_cache_hit for p in records] == [False, True, False]
    assert records[0].op_counts_after["fused_all_gather_matmul"] + records[0].op_counts_after[
        "fused_matmul_reduce_scatter"] > 0
    timing = {"compile_time_s": 0.0, "inductor_cache_hit": None}
    same = [dataclasses.replace(p, **timing) for p in records]
    assert same[1] == same[0] and same[2] == same[0]  # counts, matches, decisions, snapshots: all as first seen


SAVED_REPORT = Path(__file__).parent / "data" / "report_toy_sharded.json"


@pytest.mark.parametrize(("where", "add", "path"), [
    ("top level", lambda d: d, ""),
    ("a range", lambda d: d["ranges"][1], "ranges[1]: "),
    ("a piece", lambda d: d["ranges"][1]["pieces"][0], "ranges[1].pieces[0]: "),
    ("a piece input", lambda d: d["ranges"][1]["pieces"][0]["inputs"][0], "ranges[1].pieces[0].inputs[0]: "),
    ("a boundary", lambda d: d["ranges"][1]["boundaries"][0], "ranges[1].boundaries[0]: "),
    ("a boundary tensor", lambda d: d["ranges"][1]["boundaries"][0]["tensors"][0],
     "ranges[1].boundaries[0].tensors[0]: "),
], ids=["top", "range", "piece", "piece_input", "boundary", "boundary_tensor"])
def test_the_loader_refuses_a_field_it_does_not_know(tmp_path, where, add, path):
    """A field the reader does not know is a report from another version (or a typo), never silently dropped."""
    import json

    from sp_lab.compiler.report import ReportError

    doc = json.loads(SAVED_REPORT.read_text())
    CompileReport.from_dict(json.loads(SAVED_REPORT.read_text()))  # the unmodified report loads
    add(doc)["sharded_bytes"] = 1
    file = tmp_path / "report.json"
    file.write_text(json.dumps(doc))
    for load in (lambda: CompileReport.from_dict(doc), lambda: CompileReport.load(file)):
        with pytest.raises(ReportError) as caught:
            load()
        assert f"{path}unknown field 'sharded_bytes'" in str(caught.value), (where, str(caught.value))
