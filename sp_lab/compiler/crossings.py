"""Boundary records: for each splitting op, every tensor made before it and used at or after it."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from sp_lab.compiler.inspection import shape_json
from sp_lab.compiler.passes.graph_builder import same_size
from sp_lab.compiler.report import Boundary, BoundaryCrossing, PieceRecord, Shape
from sp_lab.compiler.split import SplitGraph
from sp_lab.compiler.tensor_names import TensorNames

__all__ = ["record_boundaries"]


def record_boundaries(
    split: SplitGraph,
    values: dict[fx.Node, Any],
    tokens: int | torch.SymInt,
    pieces: list[PieceRecord],
    names: TensorNames,
    tp_size: int,
) -> list[Boundary]:
    """The boundaries of ``split``, with the fake ``values`` its nodes took for ``tokens`` tokens.

    ``shape_before`` is what the tensor would be without SP (what the next piece expects in the in-piece
    strategies); ``shape_after`` is what really crosses after the passes; ``sharded_after`` marks a token
    shard. Names come from ``names`` (the model's, identical in every strategy).
    """
    index_of = {n: next(p.index for p in split.pieces if p.name == n.target)
                for n in split.module.graph.nodes if n.op == "call_module"}
    records = {p.index: p for p in pieces}

    def producer(node: fx.Node) -> tuple[fx.Node, int | None] | None:
        if node.op == "call_module":
            return node, None
        if node.op == "call_function" and node.args and node.args[0] in index_of:
            return node.args[0], node.args[1]
        return None

    boundaries = []
    for piece in split.pieces:
        if piece.splitting_op is None:
            continue
        crossing = []
        for node in split.module.graph.nodes:
            made = producer(node)
            val = values.get(node)
            if made is None or index_of[made[0]] >= piece.index or not isinstance(val, torch.Tensor):
                continue
            if not any(index_of.get(u, -1) >= piece.index for u in node.users):
                continue
            source, out_index = made
            outputs = records[index_of[source]].outputs if index_of[source] in records else ()
            output = next((o for o in outputs if o.index == (out_index or 0)), None)
            after = (output.shape if output is not None else None) or shape_json(val)
            before = (output.shape_before if output is not None else None) or shape_json(val)
            sharded = (after is not None and str(after[0]) != str(shape_json(val)[0])) or not same_size(
                val.shape[0], tokens)
            name = names.lookup(len(boundaries), _made_in_piece(split, source, out_index))
            crossing.append(BoundaryCrossing(
                name=name.name,
                dtype=str(val.dtype).removeprefix("torch."),
                shape_before=before if not sharded or before != after else _full_rows(after, tokens),
                shape_after=after,
                sharded_before=False,
                sharded_after=bool(sharded),
                bytes_per_token_after=_bytes_per_token(val, sharded, tp_size),
                node=node.name,
                module=name.module,
                source=name.source,
                producer_piece=index_of[source],
                producer_output=out_index or 0,
                consumer_inputs=tuple(
                    (index_of[u], list(u.args).index(node)) for u in node.users
                    if u.op == "call_module" and index_of[u] >= piece.index and node in u.args
                ),
            ))
        boundaries.append(Boundary(index=len(boundaries), splitting_op=piece.splitting_op,
                                   after_piece=piece.index - 1, before_piece=piece.index + 1,
                                   tensors=tuple(crossing)))
    return boundaries


def _made_in_piece(split: SplitGraph, call: fx.Node, out_index: int | None) -> fx.Node:
    """The node inside the producing piece (or the splitting op) that the crossing value comes from."""
    submod = split.module.get_submodule(call.target)
    output = next(n for n in reversed(submod.graph.nodes) if n.op == "output").args[0]
    if isinstance(output, (tuple, list)):
        return output[out_index or 0]
    if isinstance(output, fx.Node):
        return output
    return call


def _full_rows(shape: Shape, tokens: int | torch.SymInt) -> Shape:
    return (tokens if isinstance(tokens, int) else str(tokens), *shape[1:])


def _bytes_per_token(val: torch.Tensor, sharded: bool, tp: int) -> float:
    row = val[0].numel() * val.element_size() if val.dim() else val.element_size()
    return float(row) / (tp if sharded else 1)
