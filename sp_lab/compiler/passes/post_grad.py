"""The Inductor post-grad pass sp_lab installs in every piece: SP, then AsyncTP (after restating DTensor's
sequence-dim collectives in the form it matches), then a snapshot.

It is a ``CustomGraphPass`` whose ``uuid()`` covers everything that changes what it does (the pass sources,
tp size, rank, group, boundary policy, range, heuristic), so Inductor's FX-graph cache can never hand back a
graph compiled under other settings.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from sp_lab.compiler.inspection import graph_snapshot, op_counts, shape_json
from sp_lab.compiler.passes.async_tp import apply_async_tp
from sp_lab.compiler.passes.boundary import BoundaryPolicy
from sp_lab.compiler.passes.dtensor_collectives import merge_unfused_gathers, normalise_seq_dim_collectives
from sp_lab.compiler.passes.sequence_parallel import apply_sequence_parallel
from sp_lab.compiler.report import CountKey, PieceOutput, PieceRecord
from sp_lab.config import BoundaryStrategy
from sp_lab.rules import MatmulRule

__all__ = ["SpLabPostGradPass"]

# Everything that decides what the pass does *and what it records*: a cache hit replays the record saved
# beside Inductor's cache (``compiler/piece_compilers.py``), so the counting and record code is keyed too.
_COMPILER = Path(__file__).parents[1]
_PASS_SOURCES = sorted(Path(__file__).parent.glob("*.py")) + [
    _COMPILER / "fused_ops.py",
    _COMPILER / "inspection.py",
    _COMPILER / "report.py",
]


@dataclass
class SpLabPostGradPass(CustomGraphPass):
    """SP (``boundary`` policy at the piece edges) and AsyncTP for one piece of one compile range.

    Running it fills :attr:`record` (what it saw and did in the piece); the compiler adds what only it knows
    (timings, cache hits, input specs, fingerprint).
    """

    tp_size: int
    rank: int
    group_name: str | None
    enable_sp: bool
    enable_async_tp: bool
    boundary: BoundaryStrategy  # what SP does at this graph's edges
    m_low: int
    use_symm_mem: bool
    rule: MatmulRule | None = None
    heuristic_default: str = "fuse"
    splitting_ops: frozenset[str] = frozenset()
    token_dim: int = 0
    piece_index: int = 0  # which piece this pass runs on: labels the record, not part of uuid()
    piece_name: str = "graph"
    record: PieceRecord | None = None

    def __post_init__(self) -> None:
        self.boundary = BoundaryStrategy(self.boundary)  # a name is accepted; a bad one lists the strategies

    def __call__(self, graph: fx.Graph) -> None:
        graph_before, counts_before = graph_snapshot(graph, self.splitting_ops), op_counts(graph)
        before = {n.name for n in graph.nodes}
        output_before = [shape_json(a.meta.get("val")) if isinstance(a, fx.Node) else None for a in _outputs(graph)]
        matches: dict[CountKey, int] = {}
        sp_rewrites, copies, decisions = (), (), ()
        group = self.group_name
        if self.enable_sp:
            sp = apply_sequence_parallel(
                graph, tp_size=self.tp_size, rank=self.rank, group_name=group, policy=BoundaryPolicy(self.boundary),
                token_dim=self.token_dim,
            )
            matches.update({CountKey(f"sp_{form}"): sp.count(form) for form in ("first", "middle", "last")})
            events = sp.boundary
            matches[CountKey.BOUNDARY_GATHER] = len(events.gathered_outputs) + len(events.copies_by("gathered"))
            matches[CountKey.BOUNDARY_ERASE] = len(events.copies_by("erased"))
            sp_rewrites, copies = tuple(sp.rewrites), tuple(events.copies)
            if sp.rewrites and group is None:
                group = next(n.args[-1] for n in graph.nodes if n.op == "call_function" and "reduce_scatter" in str(n.target))
        if self.enable_async_tp and group is not None:
            seq_dim = normalise_seq_dim_collectives(graph, tp_size=self.tp_size)
            matches[CountKey.DTENSOR_SEQ_RS] = seq_dim.reduce_scatters
            matches[CountKey.DTENSOR_SEQ_AG] = seq_dim.gathers_for_matmuls
            fusion = apply_async_tp(
                graph,
                tp_size=self.tp_size,
                group_name=group,
                use_symm_mem=self.use_symm_mem,
                m_low=self.m_low,
                rule=self.rule,
                default=self.heuristic_default,
            )
            merge_unfused_gathers(graph, seq_dim)
            decisions = tuple(fusion.candidates)
            matches[CountKey.ASYNC_TP_AG_MM] = fusion.fused("all_gather_matmul")
            matches[CountKey.ASYNC_TP_MM_RS] = fusion.fused("matmul_reduce_scatter")
        self.record = PieceRecord(
            index=self.piece_index,
            name=self.piece_name,
            kind="compiled",
            matches=matches,
            op_counts_before=counts_before,
            op_counts_after=op_counts(graph),
            graph_before=graph_before,
            graph_after=graph_snapshot(graph, self.splitting_ops),
            changed=tuple(n.name for n in graph.nodes if n.name not in before),
            outputs=tuple(
                PieceOutput(i, shape_json(a.meta.get("val")) if isinstance(a, fx.Node) else None, b)
                for i, (a, b) in enumerate(zip(_outputs(graph), output_before))
            ),
            async_tp_decisions=decisions,
            sp_rewrites=sp_rewrites,
            copies=copies,
        )

    def uuid(self) -> str:
        h = hashlib.sha256()
        for path in _PASS_SOURCES:
            h.update(path.read_bytes())
        settings = (
            self.tp_size, self.rank, self.group_name, self.enable_sp, self.enable_async_tp, self.boundary,
            self.m_low, self.use_symm_mem, self.rule.uuid() if self.rule else None, self.heuristic_default,
            self.token_dim,
        )
        h.update(repr(settings).encode())
        return h.hexdigest()


def _outputs(graph: fx.Graph) -> list:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    args = out.args[0]
    return list(args) if isinstance(args, (list, tuple)) else [args]
