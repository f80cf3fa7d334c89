"""Boundary records: for each splitting op, every tensor made before it and used at or after it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import sympy
import torch
from torch import fx

from sp_lab.compiler.inspection import shape_json
from sp_lab.compiler.passes.graph_builder import same_size
from sp_lab.compiler.passes.sequence_parallel import TOKEN_SHARD, padded_shard_rows
from sp_lab.compiler.report import BoundaryCrossing, BoundaryRecord, PieceRecord, Shape
from sp_lab.compiler.split import SplitGraph
from sp_lab.compiler.tensor_names import TensorNames

__all__ = ["input_names", "record_boundaries"]


def record_boundaries(
    split: SplitGraph,
    values: dict[fx.Node, Any],
    token_shape: Sequence[int | torch.SymInt],
    pieces: list[PieceRecord],
    names: TensorNames,
    tp_size: int,
) -> list[BoundaryRecord]:
    """The boundaries of ``split``, with the fake ``values`` its nodes took for one call.

    ``token_shape`` is the token input's shape up to its token dimension (``[N]``, or ``[B, S]`` for a batch:
    ``B * S`` tokens). ``shape_before`` is what the tensor would be without SP (what the next piece expects in
    the in-piece strategies); ``shape_after`` is what really crosses after the passes; ``sharded_after`` marks
    a token shard: fewer token rows than the call has, whichever dimension holds them (``[1, c, H]`` for
    ``[1, N, H]``). Names come from ``names`` (the model's, identical in every strategy).
    """
    tokens: Any = math.prod(token_shape)
    index_of = _piece_index(split)
    records = {p.index: p for p in pieces}

    boundaries = []
    for piece in split.pieces:
        if piece.splitting_op is None:
            continue
        crossing = []
        for node, source, out_index in _crossing(split, piece.index, index_of):
            val = values.get(node)
            if not isinstance(val, torch.Tensor):
                continue
            outputs = records[index_of[source]].outputs if index_of[source] in records else ()
            output = next((o for o in outputs if o.index == (out_index or 0)), None)
            after = (output.shape if output is not None else None) or shape_json(val)
            before = (output.shape_before if output is not None else None) or shape_json(val)
            made_by = _made_in_piece(split, source, out_index)
            row_align = made_by.meta.get(TOKEN_SHARD)
            if row_align:  # SP before splitting: the value itself is a shard
                sharded = True
                t = _rows_dim(val.shape, (padded_shard_rows(tokens, tp_size, row_align), tokens // tp_size))
            else:  # in-piece SP: the walk's value is the piece's unsharded output; its record says what it became
                t = _rows_dim(val.shape, (tokens,))
                sharded = t is not None and after is not None and (
                    [str(d) for d in after[: t + 1]] != [str(d) for d in shape_json(val)[: t + 1]])
            name = names.lookup(len(boundaries), made_by)
            crossing.append(BoundaryCrossing(
                name=name.name,
                dtype=str(val.dtype).removeprefix("torch."),
                shape_before=before if not sharded or before != after or t is None
                else _full_rows(after, t, token_shape, tokens),
                shape_after=after,
                sharded_before=False,
                sharded_after=bool(sharded),
                bytes_per_token_after=_bytes_per_token(val, t if sharded else None, tokens, tp_size),
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
        boundaries.append(BoundaryRecord(index=len(boundaries), splitting_op=piece.splitting_op,
                                   after_piece=piece.index - 1, before_piece=piece.index + 1,
                                   tensors=tuple(crossing)))
    return boundaries


def input_names(split: SplitGraph, names: TensorNames) -> dict[tuple[int, int], str]:
    """The model's name of every piece input that an earlier piece made: ``(piece index, position among its
    inputs) -> name``, the name the boundary just before that piece records for it (``residual``, not Dynamo's
    ``hidden`` nor AOT's ``arg3_1``). Known before any piece compiles, so a failure while compiling one (the
    kept ``copy_`` of strategy ``none``) names its tensor as the boundary table does."""
    index_of = _piece_index(split)
    found: dict[tuple[int, int], str] = {}
    boundary = 0
    for piece in split.pieces:
        if piece.splitting_op is None:
            continue
        for node, source, out_index in _crossing(split, piece.index, index_of):
            for user in node.users:
                if user.op == "call_module" and index_of[user] == piece.index + 1:
                    name = names.lookup(boundary, _made_in_piece(split, source, out_index)).name
                    for position, arg in enumerate(user.args):
                        if arg is node:
                            found[index_of[user], position] = name
        boundary += 1
    return found


def _piece_index(split: SplitGraph) -> dict[fx.Node, int]:
    """Each ``call_module`` node of the split graph -> the index of the piece it calls."""
    return {n: next(p.index for p in split.pieces if p.name == n.target)
            for n in split.module.graph.nodes if n.op == "call_module"}


def _crossing(split: SplitGraph, cut: int, index_of: dict[fx.Node, int]) -> list[tuple[fx.Node, fx.Node, int | None]]:
    """``(node, producing call, output index)`` for every value made before piece ``cut`` and used at or after
    it: what crosses the splitting op at ``cut``."""
    out = []
    for node in split.module.graph.nodes:
        if node.op == "call_module":
            source, out_index = node, None
        elif node.op == "call_function" and node.args and node.args[0] in index_of:
            source, out_index = node.args[0], node.args[1]
        else:
            continue
        if index_of[source] < cut and any(index_of.get(u, -1) >= cut for u in node.users):
            out.append((node, source, out_index))
    return out


def _made_in_piece(split: SplitGraph, call: fx.Node, out_index: int | None) -> fx.Node:
    """The node inside the producing piece (or the splitting op) that the crossing value comes from."""
    submod = split.module.get_submodule(call.target)
    output = next(n for n in reversed(submod.graph.nodes) if n.op == "output").args[0]
    if isinstance(output, (tuple, list)):
        return output[out_index or 0]
    if isinstance(output, fx.Node):
        return output
    return call


def _rows_dim(shape: Sequence[Any], rows: Sequence[Any]) -> int | None:
    """The first dimension at which ``shape``'s leading sizes multiply to one of ``rows``, if any."""
    product: Any = 1
    for d, size in enumerate(shape):
        product = product * size
        if any(same_size(product, r) for r in rows):
            return d
    return None


def _full_rows(shape: Shape, t: int, token_shape: Sequence[Any], tokens: Any) -> Shape:
    """``shape`` (a shard, token rows in dims ``0..t``) with the call's rows: ``[B, S, ...]`` or ``[1.., N, ...]``."""
    prefix = list(token_shape) if t + 1 == len(token_shape) else [1] * t + [tokens]
    return (*(d if isinstance(d, int) else str(d) for d in prefix), *shape[t + 1:])


def _bytes_per_token(val: torch.Tensor, shard_t: int | None, tokens: Any, tp: int) -> float | None:
    """Bytes this rank holds per token of the call: a shard's row over ``tp`` (its rows are ``1/tp`` of the
    tokens), else the whole tensor over the token count (``[B, heads, S, d]``: ``heads * d`` elements). None
    where that is not one number for every token count (a tensor that does not grow with the tokens).

    Symbolic sizes are divided as expressions: turning one into a Python number would specialise the range's
    token symbol in its ShapeEnv (every later shape would print as the trace hint).
    """
    if shard_t is not None:
        size: Any = math.prod(val.shape[shard_t + 1:]) * val.element_size()
        divisor: Any = tp
    else:
        size, divisor = val.numel() * val.element_size(), tokens
    ratio = sympy.sympify(_expr(size)) / sympy.sympify(_expr(divisor))
    return float(ratio) if ratio.is_number else None


def _expr(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else size
