"""The Inductor post-grad pass sp_lab installs in every piece: SP, then AsyncTP, then a snapshot.

It is a ``CustomGraphPass`` whose ``uuid()`` covers everything that changes what it does (the pass sources,
tp size, rank, group, boundary policy, range, heuristic), so Inductor's FX-graph cache can never hand back a
graph compiled under other settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from sp_lab.compiler.passes.async_tp import apply_async_tp
from sp_lab.compiler.passes.boundary import BoundaryEvents, policy_for
from sp_lab.compiler.passes.sequence_parallel import apply_sequence_parallel
from sp_lab.compiler.report import graph_snapshot, op_counts, shape_json
from sp_lab.rules import MatmulRule

__all__ = ["PieceObservation", "SpLabPostGradPass"]

_PASS_SOURCES = sorted(Path(__file__).parent.glob("*.py")) + [Path(__file__).parents[1] / "fused_ops.py"]


@dataclass
class PieceObservation:
    """What the pass saw and did in one piece (filled in while Inductor compiles it)."""

    ran: bool = False
    graph_before: dict | None = None
    graph_after: dict | None = None
    counts_before: dict = field(default_factory=dict)
    counts_after: dict = field(default_factory=dict)
    matches: dict = field(default_factory=dict)
    changed: list[str] = field(default_factory=list)
    outputs: list[dict] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    boundary: BoundaryEvents | None = None

    def save(self, path: Path) -> None:
        """Write the observation as JSON (atomically: a concurrent compile may read it)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self)))
        os.replace(tmp, path)

    def load(self, path: Path) -> bool:
        """Fill this observation from ``path``; False when there is no readable record."""
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return False
        boundary = data.pop("boundary")
        for name, value in data.items():
            setattr(self, name, value)
        self.boundary = BoundaryEvents(**boundary) if boundary is not None else None
        return True


@dataclass
class SpLabPostGradPass(CustomGraphPass):
    """SP (``boundary`` policy at the piece edges) and AsyncTP for one piece of one compile range."""

    tp_size: int
    rank: int
    group_name: str | None
    enable_sp: bool
    enable_async_tp: bool
    boundary: str  # policy name: "none" | "gather_erase" | "gather" | "whole_graph"
    m_low: int
    use_symm_mem: bool
    rule: MatmulRule | None = None
    heuristic_default: str = "fuse"
    splitting_ops: frozenset[str] = frozenset()
    token_dim: int = 0
    observation: PieceObservation = field(default_factory=PieceObservation)

    def __call__(self, graph: fx.Graph) -> None:
        obs = self.observation
        obs.ran = True
        obs.graph_before = graph_snapshot(graph, self.splitting_ops)
        obs.counts_before = op_counts(graph)
        before = {n.name for n in graph.nodes}
        output_before = [shape_json(a.meta.get("val")) if isinstance(a, fx.Node) else None for a in _outputs(graph)]
        group = self.group_name
        if self.enable_sp:
            sp = apply_sequence_parallel(
                graph, tp_size=self.tp_size, rank=self.rank, group_name=group, policy=policy_for(self.boundary),
                token_dim=self.token_dim,
            )
            obs.matches.update({f"sp_{form}": sp.count(form) for form in ("first", "middle", "last")})
            obs.matches["boundary_gather"] = len(sp.boundary.gathered_outputs) + len(sp.boundary.gathered_copies)
            obs.matches["boundary_erase"] = len(sp.boundary.erased_copies)
            obs.boundary = sp.boundary
            if sp.rewrites and group is None:
                group = next(n.args[-1] for n in graph.nodes if n.op == "call_function" and "reduce_scatter" in str(n.target))
        if self.enable_async_tp and group is not None:
            decisions = apply_async_tp(
                graph,
                tp_size=self.tp_size,
                group_name=group,
                use_symm_mem=self.use_symm_mem,
                m_low=self.m_low,
                rule=self.rule,
                default=self.heuristic_default,
            )
            obs.decisions = decisions.candidates
            obs.matches["async_tp_ag_mm"] = decisions.fused("all_gather_matmul")
            obs.matches["async_tp_mm_rs"] = decisions.fused("matmul_reduce_scatter")
        obs.graph_after = graph_snapshot(graph, self.splitting_ops)
        obs.counts_after = op_counts(graph)
        obs.changed = [n.name for n in graph.nodes if n.name not in before]
        obs.outputs = [
            {"index": i, "shape_before": b, "shape": shape_json(a.meta.get("val")) if isinstance(a, fx.Node) else None}
            for i, (a, b) in enumerate(zip(_outputs(graph), output_before))
        ]

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
