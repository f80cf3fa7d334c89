"""Where a boundary tensor comes from and where it goes: its producers and consumers in both pieces.

The producing piece's graph returns the tensor through its output node; the consuming piece receives it as a
graph input (placeholder) and its consumers read that. When the report records which output and which input
the tensor is (``producer_output``, ``consumer_inputs``), that is used; otherwise candidates are matched by
shape and dtype and flagged ``exact=False`` (two ``[s, 4096]`` float tensors cannot be told apart that way).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sp_lab.compiler.report import NodeRecord
from sp_lab.viz.overview import format_shape
from sp_lab.viz.piece_graph import short_op
from sp_lab.viz.report_input import as_report, resolve_range

if TYPE_CHECKING:
    from sp_lab.viz.report_input import ReportSource

__all__ = ["NodeRef", "TensorLinks", "tensor_links"]


@dataclass(frozen=True)
class NodeRef:
    """One FX node of one piece, as the widget lists it."""

    piece: int
    name: str
    op: str
    module: str | None
    shape: tuple

    @property
    def text(self) -> str:
        where = f" · {self.module}" if self.module else ""
        return f"piece {self.piece}: {self.name} ({self.op}{where}) {format_shape(self.shape)}"


@dataclass(frozen=True)
class TensorLinks:
    """A boundary tensor's producers (in the piece before) and consumers (in the pieces after)."""

    boundary: int
    tensor: str
    producers: tuple[NodeRef, ...]
    consumers: tuple[NodeRef, ...]
    exact: bool
    """False when matched by shape and dtype only (the report did not say which output/input it is)."""


def _ref(piece: int, node: NodeRecord) -> NodeRef:
    return NodeRef(piece=piece, name=node.name, op=short_op(str(node.target)), module=node.module,
                   shape=tuple(node.shape or ()))


def tensor_links(report: ReportSource, range_index: int | None, boundary_index: int, tensor_index: int) -> TensorLinks:
    """Producers and consumers of tensor ``tensor_index`` of boundary ``boundary_index``, in the graphs after the
    passes."""
    report = as_report(report)
    rng = report.ranges[resolve_range(report, range_index)]
    boundary = next((b for b in rng.boundaries if b.index == boundary_index), None)
    if boundary is None or not 0 <= tensor_index < len(boundary.tensors):
        raise IndexError(f"no tensor {tensor_index} at boundary {boundary_index}; this range has boundaries "
                         f"{[b.index for b in rng.boundaries]}")
    t = boundary.tensors[tensor_index]
    pieces = {p.index: p for p in rng.pieces}
    # Reports of schema 2 say which output made it and which inputs read it; older ones are matched by shape.
    exact = t.producer_output is not None and bool(t.consumer_inputs)
    want = (tuple(t.shape_after or ()), t.dtype)

    def fits(node: NodeRecord) -> bool:
        return (tuple(node.shape or ()), node.dtype) == want

    producers: list[NodeRef] = []
    made_in = t.producer_piece if exact and t.producer_piece is not None else boundary.after_piece
    producer = pieces.get(made_in)
    graph = producer and (producer.graph_after or producer.graph_before)
    if graph is not None:
        by_name = {n.name: n for n in graph.nodes}
        returned = [by_name[a] for a, b in graph.edges if by_name.get(b) is not None and by_name[b].op == "output"]
        if exact:
            returned = returned[t.producer_output:t.producer_output + 1]
        producers = [_ref(made_in, n) for n in returned if exact or fits(n)]

    consumers: list[NodeRef] = []
    targets = [tuple(c) for c in t.consumer_inputs] if exact else [
        (i, None) for i in sorted(pieces) if i > boundary.after_piece and pieces[i].kind == "compiled"]
    for piece_index, input_index in targets:
        piece = pieces.get(piece_index)
        graph = piece and (piece.graph_after or piece.graph_before)
        if graph is None:
            continue
        succs: dict[str, list[str]] = defaultdict(list)
        for a, b in graph.edges:
            succs[a].append(b)
        by_name = {n.name: n for n in graph.nodes}
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        chosen = inputs[input_index:input_index + 1] if input_index is not None else [n for n in inputs if fits(n)]
        consumers += [_ref(piece_index, by_name[s]) for n in chosen for s in succs[n.name]]
        if not exact and chosen:
            break  # by shape: the first later piece that receives such a tensor
    return TensorLinks(boundary=boundary_index, tensor=t.name, producers=tuple(producers),
                       consumers=tuple(consumers), exact=exact)
