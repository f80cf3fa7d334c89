"""DTensor's sequence-dim collectives, rewritten as the token-major collectives AsyncTP fuses.

DTensor collects along dimension 0 only. For ``Shard(1)`` of a ``[1, N, H]`` activation (torchtitan's
``SequenceParallel``) it spells

- the reduce_scatter after a row-parallel matmul as ``split(x, N / tp, dim=1)`` -> ``cat(dim=0)`` ->
  ``reduce_scatter_tensor``, and
- the all_gather before a column-parallel matmul as ``all_gather_into_tensor([1, N / tp, H])`` ->
  ``[tp, N / tp, H]`` -> views -> ``[N, H]`` -> ``mm``,

so AsyncTP's patterns (``mm -> reduce_scatter``, ``all_gather -> mm``, on ``[N, H]``) never see the pairs.
When every dimension before the token dimension has size 1 (batch 1), ``[1, N, H]`` and ``[tp, N / tp, H]`` are
the same row-major tensor as ``[N, H]``: the split/cat is only a view, and a gather of ``[N / tp, H]`` rows is the
same bytes as DTensor's. The rewrite states the collectives that way:

- ``reduce_scatter(cat(split(x)))`` becomes ``reduce_scatter(x as [N, H])`` (the matmul's own output when ``x``
  is a view of it), viewed back to ``[1, N / tp, H]``;
- ``all_gather(a)`` gathers ``a as [N / tp, H]``, and every matmul reading the result (through views) as
  ``[N, H]`` gets a gather of its own, as sp_lab's SP pass gives each matmul: AsyncTP's fused op has one B.
  Those AsyncTP then leaves unfused (its gate said no) are merged back into one gather per shard afterwards
  (:func:`merge_unfused_gathers`), so a matmul the heuristic rejects costs no more traffic than DTensor's graph.

Find, then rewrite. A batch > 1 keeps DTensor's spelling (there the split/cat really moves data).
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from sp_lab.compiler.passes.graph_builder import GraphBuilder, same_size
from sp_lab.compiler.passes.sequence_parallel import VIEWS

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
log = logging.getLogger(__name__)

__all__ = ["SeqDimCollectives", "merge_unfused_gathers", "normalise_seq_dim_collectives"]


@dataclass
class SeqDimCollectives:
    """What the rewrite did: DTensor's split/cat reduce_scatters restated on ``[N, H]``, and its all_gathers
    restated as one ``[N / tp, H]`` gather per matmul reading it (``gathers_for_matmuls`` of them in all)."""

    reduce_scatters: int = 0
    gathers_for_matmuls: int = 0
    gathers: list[fx.Node] = field(default_factory=list)  # the per-matmul gathers' waits, for the merge after AsyncTP


def normalise_seq_dim_collectives(graph: fx.Graph, *, tp_size: int) -> SeqDimCollectives:
    """Rewrite DTensor's batch-1 sequence-dim collectives of ``graph`` in place (see the module docstring)."""
    result = SeqDimCollectives()
    reduce_scatters, all_gathers = [], []
    for node in graph.nodes:
        if node.target is c10d.reduce_scatter_tensor.default and node.args[2] == tp_size:
            found = _split_cat_source(node.args[0], tp_size)
            if found is not None:
                reduce_scatters.append((node, *found))
        elif node.target is c10d.all_gather_into_tensor.default and node.args[1] == tp_size:
            reason = _batch_one(node.args[0])
            if reason is None:
                all_gathers.append(node)
            else:
                log.debug("DTensor all_gather %s left as written: %s", node.name, reason)
    for node, source, token_dim in reduce_scatters:
        _rewrite_reduce_scatter(graph, node, source, token_dim)
        result.reduce_scatters += 1
    for node in all_gathers:
        waits = _rewrite_all_gather(graph, node)
        if waits:
            result.gathers_for_matmuls += len(waits)
            result.gathers.extend(waits)
    return result


def merge_unfused_gathers(graph: fx.Graph, rewritten: SeqDimCollectives) -> int:
    """Merge the per-matmul gathers of one shard that AsyncTP did not fuse into the first of them; return how
    many were merged away. (A fused gather was replaced by AsyncTP and is no longer in the graph.)"""
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_shard: dict[fx.Node, list[fx.Node]] = {}
    for wait in rewritten.gathers:
        if wait in order:
            by_shard.setdefault(wait.args[0].args[0], []).append(wait)
    merged = 0
    for waits in by_shard.values():
        first, *rest = sorted(waits, key=order.__getitem__)
        for wait in rest:  # every later gather's readers come after the first gather
            wait.replace_all_uses_with(first)
            _erase_dead([wait, wait.args[0]])
            merged += 1
    return merged


# -- find ------------------------------------------------------------------------------------------------------
def _val(node: Any) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _same_shape(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def _batch_one(node: Any) -> str | None:
    """None if ``node``'s value is ``[1, ..., H]`` (dim 0 of size 1, at least 2-D); else why not."""
    val = _val(node)
    if val is None or val.dim() < 2:
        return "input is not a tensor of two or more dimensions"
    if not same_size(val.shape[0], 1):
        return f"leading dimension {val.shape[0]} is not 1 (a batch > 1 really needs DTensor's split/cat)"
    return None


def _split_cat_source(cat: Any, tp_size: int) -> tuple[fx.Node, int] | None:
    """``(x, d)`` if ``cat`` is ``cat([split(x, N / tp, d)[i] for i in range(tp)], 0)`` of a ``[1.., N, ...]`` x."""
    if not isinstance(cat, fx.Node) or cat.target is not aten.cat.default or len(cat.users) != 1:
        return None
    if (cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)) != 0:
        return None
    parts = cat.args[0]
    if len(parts) != tp_size or not all(p.target is operator.getitem and p.args[1] == i for i, p in enumerate(parts)):
        return None
    splits = {p.args[0] for p in parts}
    if not all(s.target is aten.split.Tensor for s in splits):
        return None
    sources = {(s.args[0], s.args[1], s.args[2] if len(s.args) > 2 else s.kwargs.get("dim", 0)) for s in splits}
    if len(sources) != 1:
        return None
    (x, size, dim), = sources
    val = _val(x)
    size = size.meta.get("val") if isinstance(size, fx.Node) else size
    if val is None or size is None or dim < 1 or dim >= val.dim():
        return None
    # Equal chunks, and nothing but size-1 dimensions before the split one: the cat is a view of x.
    if not same_size(val.shape[dim], size * tp_size) or not all(same_size(d, 1) for d in val.shape[:dim]):
        return None
    if _static_width(val, dim + 1) is None:
        return None
    return x, dim


def _is_noop_slice(node: fx.Node) -> bool:
    if node.target is not aten.slice.Tensor or (len(node.args) > 4 and node.args[4] != 1):
        return False
    src, out = _val(node.args[0]), _val(node)
    return src is not None and out is not None and len(node.args) > 2 and node.args[2] == 0 \
        and _same_shape(src.shape, out.shape)


def _reshapes(node: fx.Node) -> bool:
    """A node whose value is its input read row-major in another shape."""
    return node.target in VIEWS or _is_noop_slice(node)


def _row_major_ancestor(node: fx.Node, shape: Any) -> fx.Node | None:
    """The nearest of ``node`` and its reshape ancestors whose value has ``shape`` (views keep row-major order)."""
    while True:
        val = _val(node)
        if val is not None and _same_shape(val.shape, shape):
            return node
        if not _reshapes(node):
            return None
        node = node.args[0]


# -- rewrite -----------------------------------------------------------------------------------------------------
def _as_2d(build: GraphBuilder, x: fx.Node, rows: Any, width: int) -> fx.Node:
    """``x`` read as ``[rows, width]``: an ancestor that already is (the matmul), else a reshape (``-1``: the
    token count stays out of the graph's constants)."""
    return _row_major_ancestor(x, [rows, width]) or build.view(x, [-1, width])


def _static_width(val: torch.Tensor, first: int) -> int | None:
    """The product of ``val``'s dimensions from ``first`` on, if none of them is symbolic."""
    dims = val.shape[first:]
    return math.prod(dims) if all(isinstance(d, int) for d in dims) else None


def _rewrite_reduce_scatter(graph: fx.Graph, rs: fx.Node, x: fx.Node, token_dim: int) -> None:
    wait = next(iter(rs.users))
    val = _val(x)
    rows, width = val.shape[token_dim], _static_width(val, token_dim + 1)
    with graph.inserting_before(rs):
        build = GraphBuilder(graph)
        with build.standing_for(rs):
            flat = _as_2d(build, x, rows, width)
            scattered = build.call(c10d.wait_tensor.default,
                                   build.call(c10d.reduce_scatter_tensor.default, flat, *rs.args[1:]))
            back = build.view(scattered, [1] * token_dim + [-1, *val.shape[token_dim + 1:]])
    wait.replace_all_uses_with(back)
    _erase_dead([wait, rs, rs.args[0]])


def _rewrite_all_gather(graph: fx.Graph, ag: fx.Node) -> list[fx.Node]:
    """Gather ``[N / tp, H]`` rows; give each matmul reading the gathered ``[N, H]`` its own gather. Returns the
    new gathers' waits (none: the gather is left as DTensor wrote it)."""
    wait = next((u for u in ag.users if u.target is c10d.wait_tensor.default), None)
    if wait is None or len(ag.users) != 1:
        return []
    shard = ag.args[0]
    val = _val(shard)
    rows, width = math.prod(val.shape[:-1]), _static_width(val, val.dim() - 1)
    if width is None:
        return []
    full = [rows * ag.args[1], width]
    matmuls = [(mm, view) for view in _reshape_descendants(wait)
               if _same_shape(_val(view).shape, full) for mm in view.users
               if mm.target is aten.mm.default and mm.args[0] is view]
    if not matmuls:
        return []
    with graph.inserting_before(ag):
        build = GraphBuilder(graph)
        with build.standing_for(ag):
            flat = _as_2d(build, shard, rows, width)
    waits = []
    for mm, _ in matmuls:
        with graph.inserting_before(mm):
            build = GraphBuilder(graph)
            with build.standing_for(ag):
                waits.append(build.all_gather(flat, ag.args[1], ag.args[2]))
                mm.replace_input_with(mm.args[0], waits[-1])
    # Whatever else reads DTensor's gather keeps reading it.
    _erase_dead([view for _, view in matmuls] + [wait, ag])
    return waits


def _reshape_descendants(node: fx.Node) -> list[fx.Node]:
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(u for u in current.users if _reshapes(u) and u.args[0] is current)
    return found


def _erase_dead(nodes: list[fx.Node]) -> None:
    """Erase ``nodes`` once nothing reads them, then their inputs that nothing reads any more: the replaced
    collective and its split/cat/views. Other impure inputs stay (Inductor decides about those)."""
    erased: set[fx.Node] = set()
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        if node in erased or node.users or node.op != "call_function":
            continue
        if node not in nodes and node.is_impure() and node.target not in _COLLECTIVES:
            continue
        inputs = node.all_input_nodes
        node.graph.erase_node(node)
        erased.add(node)
        stack.extend(inputs)


_COLLECTIVES = {c10d.wait_tensor.default, c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default}
