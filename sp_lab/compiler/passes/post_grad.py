"""The Inductor post-grad passes sp_lab installs in every piece, and the manager that runs them.

Modelled on vLLM's ``PostGradPassManager``: a list of pass objects, each one class that knows

- whether it applies to a compile range (:meth:`PostGradPass.applies`),
- what it does to the graph and which part of the piece record it writes (:meth:`PostGradPass.__call__` on
  the :class:`PieceDraft`; :meth:`PostGradPass.finish` once every pass has run),
- its own cache key (:meth:`PostGradPass.uuid`: its code and its settings).

:class:`PostGradPassManager` is what Inductor gets as ``post_grad_custom_post_pass``: it snapshots the graph,
runs the applicable passes in order, and builds the :class:`~sp_lab.compiler.report.PieceRecord`. Its
``uuid()`` hashes the whole list (every pass's uuid and the code that records), so Inductor's FX-graph cache
can never hand back a graph compiled under other settings, and a record replayed beside the cache is the one
those settings made. Adding a pass is one class and one line of :func:`sp_lab_passes`.

The passes, in order: :class:`SequenceParallelPass` (``all_reduce -> norm`` into reduce_scatter / all_gather,
the boundary strategy at the graph's edges), :class:`DTensorSeqDimPass` (DTensor's sequence-dim collectives
restated in the form AsyncTP matches, merged back where it declined) and :class:`AsyncTPPass` (the fusions).
"""

from __future__ import annotations

import dataclasses
import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from sp_lab.compiler.inspection import graph_snapshot, op_counts, shape_json
from sp_lab.compiler.passes.async_tp import apply_async_tp
from sp_lab.compiler.passes.boundary import BoundaryPolicy
from sp_lab.compiler.passes.dtensor_collectives import (
    SeqDimCollectives,
    merge_unfused_gathers,
    normalise_seq_dim_collectives,
)
from sp_lab.compiler.passes.sequence_parallel import apply_sequence_parallel
from sp_lab.compiler.ranges import CompileRange
from sp_lab.compiler.report import CopyEvent, CountKey, FusionDecision, PieceOutput, PieceRecord, SPRewrite
from sp_lab.config import BoundaryStrategy
from sp_lab.rules import MatmulRule

__all__ = ["AsyncTPPass", "DTensorSeqDimPass", "PieceDraft", "PostGradPass", "PostGradPassManager",
           "SequenceParallelPass", "sp_lab_passes"]

_HERE = Path(__file__).parent
_COMPILER = _HERE.parent
_GRAPH_BUILDER = _HERE / "graph_builder.py"  # every rewrite builds its nodes with it

# The code that turns what the passes did into the piece record: a cache hit replays the record saved beside
# Inductor's cache (``compiler/piece_compilers.py``), so the counting and record code is keyed too.
_RECORD_SOURCES = [Path(__file__), _COMPILER / "inspection.py", _COMPILER / "report.py"]


@dataclass
class PieceDraft:
    """What the passes found and did in one piece so far; each pass writes its own part."""

    group_name: str | None
    """The TP group's name: from the settings, or found by SP in the reduce_scatters it made."""
    matches: dict[CountKey, int] = field(default_factory=dict)
    sp_rewrites: tuple[SPRewrite, ...] = ()
    copies: tuple[CopyEvent, ...] = ()
    async_tp_decisions: tuple[FusionDecision, ...] = ()
    seq_dim: SeqDimCollectives | None = None
    """The DTensor restatement, kept until :meth:`DTensorSeqDimPass.finish` merges what stayed unfused."""


class PostGradPass(ABC):
    """One rewrite of a piece's post-grad graph. Subclasses are frozen dataclasses: their fields are their
    settings, and :meth:`uuid` keys them with the code in :attr:`sources`."""

    sources: ClassVar[tuple[Path, ...]]
    """The files whose code decides what this pass does."""

    @abstractmethod
    def applies(self, compile_range: CompileRange) -> bool:
        """Whether the pass runs in the artifact of ``compile_range``."""

    @abstractmethod
    def __call__(self, graph: fx.Graph, draft: PieceDraft) -> None:
        """Rewrite ``graph`` in place and write this pass's part of ``draft``."""

    def finish(self, graph: fx.Graph, draft: PieceDraft) -> None:
        """Run after every applicable pass has (in the same order); nothing unless a pass needs it."""

    def uuid(self) -> str:
        h = hashlib.sha256(type(self).__qualname__.encode())
        for path in self.sources:
            h.update(path.read_bytes())
        settings = [(f.name, _key(getattr(self, f.name))) for f in dataclasses.fields(self)]
        h.update(repr(settings).encode())
        return h.hexdigest()


def _key(value: Any) -> Any:
    """A setting as it enters a cache key (a rule by its own uuid)."""
    return value.uuid() if hasattr(value, "uuid") else value


@dataclass(frozen=True)
class SequenceParallelPass(PostGradPass):
    """SP: token-major summing ``all_reduce``s become ``reduce_scatter`` / ``all_gather``; ``boundary`` says
    what happens where a shard leaves the graph."""

    tp_size: int
    rank: int
    group_name: str | None
    boundary: BoundaryStrategy
    token_dim: int = 0
    sources: ClassVar = (_HERE / "sequence_parallel.py", _HERE / "boundary.py", _GRAPH_BUILDER)

    def __post_init__(self) -> None:
        object.__setattr__(self, "boundary", BoundaryStrategy(self.boundary))  # a bad name lists the strategies

    def applies(self, compile_range: CompileRange) -> bool:
        return compile_range.enable_sp

    def __call__(self, graph: fx.Graph, draft: PieceDraft) -> None:
        sp = apply_sequence_parallel(graph, tp_size=self.tp_size, rank=self.rank, group_name=draft.group_name,
                                     policy=BoundaryPolicy(self.boundary), token_dim=self.token_dim)
        draft.matches.update(sp.matches())
        draft.sp_rewrites, draft.copies = tuple(sp.rewrites), tuple(sp.boundary.copies)
        if sp.rewrites and draft.group_name is None:
            draft.group_name = next(n.args[-1] for n in graph.nodes
                                    if n.op == "call_function" and "reduce_scatter" in str(n.target))


@dataclass(frozen=True)
class DTensorSeqDimPass(PostGradPass):
    """DTensor's batch-1 sequence-dim collectives restated as ``[N, H]`` ones, one gather per matmul, so that
    AsyncTP matches them; afterwards, the gathers AsyncTP left unfused are merged back into one."""

    tp_size: int
    sources: ClassVar = (_HERE / "dtensor_collectives.py", _GRAPH_BUILDER)

    def applies(self, compile_range: CompileRange) -> bool:
        return compile_range.enable_async_tp

    def __call__(self, graph: fx.Graph, draft: PieceDraft) -> None:
        if draft.group_name is None:  # no collective of a known group: nothing AsyncTP could fuse
            return
        draft.seq_dim = normalise_seq_dim_collectives(graph, tp_size=self.tp_size)
        draft.matches[CountKey.DTENSOR_SEQ_RS] = draft.seq_dim.reduce_scatters
        draft.matches[CountKey.DTENSOR_SEQ_AG] = draft.seq_dim.gathers_for_matmuls

    def finish(self, graph: fx.Graph, draft: PieceDraft) -> None:
        if draft.seq_dim is not None:
            merge_unfused_gathers(graph, draft.seq_dim)


@dataclass(frozen=True)
class AsyncTPPass(PostGradPass):
    """AsyncTP: ``all_gather -> mm`` and ``mm -> reduce_scatter`` fused, each matmul gated by ``rule`` at
    ``m_low`` tokens (the range's low end)."""

    tp_size: int
    m_low: int
    use_symm_mem: bool
    rule: MatmulRule | None = None
    heuristic_default: str = "fuse"
    sources: ClassVar = (_HERE / "async_tp.py", _COMPILER / "fused_ops.py", _COMPILER.parent / "rules.py",
                         _GRAPH_BUILDER)

    def applies(self, compile_range: CompileRange) -> bool:
        return compile_range.enable_async_tp

    def __call__(self, graph: fx.Graph, draft: PieceDraft) -> None:
        if draft.group_name is None:
            return
        fusion = apply_async_tp(graph, tp_size=self.tp_size, group_name=draft.group_name,
                                use_symm_mem=self.use_symm_mem, m_low=self.m_low, rule=self.rule,
                                default=self.heuristic_default)
        draft.async_tp_decisions = tuple(fusion.candidates)
        draft.matches[CountKey.ASYNC_TP_AG_MM] = fusion.fused("all_gather_matmul")
        draft.matches[CountKey.ASYNC_TP_MM_RS] = fusion.fused("matmul_reduce_scatter")


def sp_lab_passes(*, tp_size: int, rank: int, group_name: str | None, boundary: BoundaryStrategy,
                  m_low: int, use_symm_mem: bool, rule: MatmulRule | None = None, heuristic_default: str = "fuse",
                  token_dim: int = 0, sp: bool = True) -> tuple[PostGradPass, ...]:
    """sp_lab's passes in the order they run. ``sp=False``: SP already ran on the whole graph (``sharded``)."""
    return (
        *([SequenceParallelPass(tp_size, rank, group_name, boundary, token_dim)] if sp else []),
        DTensorSeqDimPass(tp_size),
        AsyncTPPass(tp_size, m_low, use_symm_mem, rule, heuristic_default),
    )


@dataclass
class PostGradPassManager(CustomGraphPass):
    """Runs ``passes`` (those that apply to ``compile_range``) on one piece and fills :attr:`record`.

    The compiler adds to the record what only it knows (timings, cache hits, input specs, fingerprint).
    """

    passes: tuple[PostGradPass, ...]
    compile_range: CompileRange
    group_name: str | None = None
    splitting_ops: frozenset[str] = frozenset()
    piece_index: int = 0  # which piece this runs on: labels the record, not part of uuid()
    piece_name: str = "graph"
    record: PieceRecord | None = None

    def __call__(self, graph: fx.Graph) -> None:
        graph_before, counts_before = graph_snapshot(graph, self.splitting_ops), op_counts(graph)
        before = {n.name for n in graph.nodes}
        output_before = [shape_json(a.meta.get("val")) if isinstance(a, fx.Node) else None for a in _outputs(graph)]
        draft = PieceDraft(self.group_name)
        applicable = [p for p in self.passes if p.applies(self.compile_range)]
        for p in applicable:
            p(graph, draft)
        for p in applicable:
            p.finish(graph, draft)
        self.record = PieceRecord(
            index=self.piece_index,
            name=self.piece_name,
            kind="compiled",
            matches=draft.matches,
            op_counts_before=counts_before,
            op_counts_after=op_counts(graph),
            graph_before=graph_before,
            graph_after=graph_snapshot(graph, self.splitting_ops),
            changed=tuple(n.name for n in graph.nodes if n.name not in before),
            outputs=tuple(
                PieceOutput(i, shape_json(a.meta.get("val")) if isinstance(a, fx.Node) else None, b)
                for i, (a, b) in enumerate(zip(_outputs(graph), output_before))
            ),
            async_tp_decisions=draft.async_tp_decisions,
            sp_rewrites=draft.sp_rewrites,
            copies=draft.copies,
        )

    def uuid(self) -> str:
        h = hashlib.sha256()
        for path in _RECORD_SOURCES:
            h.update(path.read_bytes())
        for p in self.passes:
            h.update(p.uuid().encode())
        r = self.compile_range
        h.update(repr((r.enable_sp, r.enable_async_tp, self.group_name, sorted(self.splitting_ops))).encode())
        return h.hexdigest()


def _outputs(graph: fx.Graph) -> list:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    args = out.args[0]
    return list(args) if isinstance(args, (list, tuple)) else [args]
