"""The post-grad pass manager: a list of passes, each keyed by its own uuid, the list keying Inductor's cache."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import fx

from sp_lab.compiler.passes.post_grad import (
    AsyncTPPass,
    PieceDraft,
    PostGradPass,
    PostGradPassManager,
    SequenceParallelPass,
    sp_lab_passes,
)
from sp_lab.compiler.piece_compilers import InductorPieces
from sp_lab.compiler.ranges import CompileRange
from sp_lab.rules import Leaf, MatmulRule

FUSING = CompileRange(8, 64, enable_sp=True, enable_async_tp=True)


def manager(passes, compile_range=FUSING, **kw) -> PostGradPassManager:
    return PostGradPassManager(tuple(passes), compile_range, group_name="g", **kw)


def default_passes(**overrides):
    settings = {"tp_size": 2, "rank": 0, "group_name": "g", "boundary": "gather", "m_low": 8, "use_symm_mem": False}
    return sp_lab_passes(**{**settings, **overrides})


@pytest.mark.parametrize("change", [
    {"boundary": "gather_erase"}, {"m_low": 16}, {"use_symm_mem": True}, {"heuristic_default": "no_fuse"},
    {"rule": MatmulRule(Leaf("no_fuse"))}, {"token_dim": 1}, {"sp": False},
], ids=lambda c: next(iter(c)))
def test_changing_one_pass_changes_that_pass_and_the_managers_key(change):
    before, after = default_passes(), default_passes(**change)
    changed = [type(a).__name__ for a, b in zip(before, after, strict=False) if a.uuid() != b.uuid()]
    assert changed or len(before) != len(after)
    assert manager(before).uuid() != manager(after).uuid()
    if len(before) == len(after):  # the others keep their keys: each pass is keyed by what it reads
        assert len(changed) == 1, changed


def test_the_key_follows_a_passes_code_and_not_the_pieces_label(tmp_path, monkeypatch):
    passes = default_passes()
    assert manager(passes, piece_index=3, piece_name="submod_3").uuid() == manager(passes).uuid()
    edited = tmp_path / "async_tp.py"
    edited.write_text(AsyncTPPass.sources[0].read_text() + "\n# a changed pattern\n")
    before = manager(passes).uuid()
    monkeypatch.setattr(AsyncTPPass, "sources", (edited, *AsyncTPPass.sources[1:]))
    assert manager(passes).uuid() != before


def test_a_pass_applies_per_range():
    sp_only = CompileRange(1, 7, enable_sp=True, enable_async_tp=False)
    assert [type(p).__name__ for p in default_passes() if p.applies(sp_only)] == ["SequenceParallelPass"]
    assert not any(p.applies(CompileRange(1, 7, enable_sp=False, enable_async_tp=False)) for p in default_passes())
    with pytest.raises(ValueError, match="choose from none, gather_erase, gather, sharded"):
        SequenceParallelPass(2, 0, None, "whole_graph")


@dataclasses.dataclass(frozen=True)
class ScaleBy(PostGradPass):
    """A pass written as a user would add one: every ``x * c`` becomes ``x * factor``."""

    factor: float
    sources: ClassVar = (Path(__file__),)

    def applies(self, compile_range: CompileRange) -> bool:
        return True

    def __call__(self, graph: fx.Graph, draft: PieceDraft) -> None:
        for node in graph.find_nodes(op="call_function", target=torch.ops.aten.mul.Tensor):
            node.args = (node.args[0], self.factor)


def test_a_changed_pass_never_gets_a_stale_inductor_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # an empty FX-graph cache of this test's own
    x = torch.arange(4.0)

    def run(factor: float) -> tuple[torch.Tensor, bool]:
        seen = []

        def backend(gm: fx.GraphModule, example_inputs: list) -> object:
            seen.append(InductorPieces()(gm, example_inputs, manager([ScaleBy(factor)], CompileRange(1, 4, False, False))))
            return seen[-1].fn

        torch._dynamo.reset()
        out = torch.compile(lambda t: t * 2.0, backend=backend)(x)
        return out, seen[0].inductor_cache_hit

    assert torch.equal(run(3.0)[0], 3 * x)
    out, hit = run(5.0)  # same graph, another pass setting: compiled again, not Inductor's 3x graph
    assert torch.equal(out, 5 * x) and not hit
    out, hit = run(3.0)  # the first setting again: now the cache serves it (so the cache was on all along)
    assert torch.equal(out, 3 * x) and hit
    torch._dynamo.reset()


def test_a_piece_compiled_again_after_its_record_was_lost_still_returns_its_value(tmp_path, monkeypatch):
    # Inductor's cache hit but the record beside it is missing (another rank has not written it yet, or a fresh
    # artifact cache over a warm Inductor cache): the piece is compiled a second time. A split piece returns one
    # value; a second compile must not hand the next piece a list.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("SP_LAB_CACHE_DIR", str(tmp_path / "sp_lab"))
    gm = fx.symbolic_trace(lambda t: t * 2.0)  # one value out, as a piece of a split graph
    x = torch.arange(4.0)
    passes = manager([ScaleBy(3.0)], CompileRange(1, 4, False, False))
    assert torch.equal(InductorPieces()(gm, [x], passes).fn(x), 3 * x)
    records = list((tmp_path / "sp_lab").rglob("*.json"))
    assert records, "the pass's record was not kept beside the cache"
    for record in records:
        record.unlink()
    again = InductorPieces()(gm, [x], manager([ScaleBy(3.0)], CompileRange(1, 4, False, False)))
    assert not again.inductor_cache_hit  # compiled again with the cache off, so the record is real
    out = again.fn(x)
    assert isinstance(out, torch.Tensor), f"the piece returned a {type(out).__name__}"
    assert torch.equal(out, 3 * x)
