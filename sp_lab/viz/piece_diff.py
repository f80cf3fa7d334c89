"""What the passes did to one piece: its graph before and after, and the rewritten neighbourhoods.

A *diff region* is one place the passes rewrote: the FX nodes they removed and added there (joined when they
touch, directly or through one kept node), plus one ring of kept neighbours on each side for context. A region
is titled by the collectives and fused ops it traded, e.g. ``SP + AsyncTP: 1 AR, 2 mm → 1 mm+RS, 1 AG+mm``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import polars as pl

from sp_lab.compiler.report import COLLECTIVE_KEYS, CountKey, GraphSnapshot, NodeRecord, RangeReport
from sp_lab.viz.overview import OP_ABBREVIATIONS, PieceBox, overview_data
from sp_lab.viz.piece_graph import PieceGraph, collapse, infer_modules, is_folded, short_op
from sp_lab.viz.report_input import as_report, resolve_range

if TYPE_CHECKING:
    from sp_lab.viz.report_input import ReportSource

__all__ = ["DiffRegion", "PieceDiffData", "diff_regions", "piece_diff_data"]

# Short op name in a snapshot -> the report's op key (for titles); the compiler counts the same ops.
_OP_KEYS = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
            "all_gather_into_tensor": "all_gather", "fused_all_gather_matmul": "fused_all_gather_matmul",
            "fused_matmul_reduce_scatter": "fused_matmul_reduce_scatter", "mm": "mm", "addmm": "mm"}


_MAX_BRIDGE_DEGREE = 4  # a kept node read by more than this does not join rewrites into one region


def _op_key(target: str) -> str | None:
    parts = target.split(".")
    return _OP_KEYS.get(parts[1] if len(parts) >= 2 else parts[0])


@dataclass(frozen=True)
class DiffRegion:
    """One rewritten neighbourhood of a piece."""

    index: int
    """Position among the piece's regions, in graph order."""
    title: str
    """What was traded, e.g. ``"SP + AsyncTP: 1 AR, 2 mm → 1 mm+RS, 1 AG+mm"``."""
    module: str | None
    """The module where it happened (of the first removed or added node that has one)."""
    removed: tuple[str, ...]
    """FX names the passes removed here."""
    added: tuple[str, ...]
    """FX names the passes added here."""
    before: PieceGraph
    """The neighbourhood before the passes (removed nodes marked changed)."""
    after: PieceGraph
    """The neighbourhood after (added nodes marked changed)."""


@dataclass(frozen=True)
class PieceDiffData:
    """One piece before and after the SP and AsyncTP passes."""

    range_index: int
    """Position of the piece's range in the report."""
    range: RangeReport
    """Range the piece belongs to (the compiler's record)."""
    piece: PieceBox
    """The piece."""
    before: PieceGraph
    """Whole graph before the passes; ``changed`` marks runs holding removed nodes."""
    after: PieceGraph
    """Whole graph after the passes; ``changed`` marks runs holding added nodes."""
    added: tuple[str, ...]
    """FX names the passes added."""
    removed: tuple[str, ...]
    """FX names present before but not after."""
    regions: tuple[DiffRegion, ...]
    """The rewritten neighbourhoods."""
    op_counts: pl.DataFrame
    """Columns op, before, after, delta."""
    provenance: str
    """Where the report was compiled (:func:`~sp_lab.viz.report_input.report_provenance`)."""


def _adjacency(snapshot: GraphSnapshot) -> dict[str, set[str]]:
    adj: dict[str, set[str]] = defaultdict(set)
    for a, b in snapshot.edges:
        adj[a].add(b)
        adj[b].add(a)
    return adj


def _title(removed: Sequence[NodeRecord], added: Sequence[NodeRecord], *, boundary: bool) -> str:
    def counts(nodes: Sequence[NodeRecord]) -> str:
        c = Counter(k for k in (_op_key(n.target) for n in nodes) if k)
        return ", ".join(f"{c[k]} {OP_ABBREVIATIONS[k]}" for k in (*COLLECTIVE_KEYS, CountKey.MM) if c[k]) or f"{len(nodes)} ops"

    gone = {_op_key(n.target) for n in removed}
    new = {_op_key(n.target) for n in added}
    # SP trades all_reduce for reduce_scatter / all_gather and re-creates the norm on the token shard;
    # AsyncTP trades a collective and a matmul for one fused op.
    sp = "all_reduce" in gone or new & {"reduce_scatter", "all_gather"} or any(n.kind == "norm" for n in added)
    async_tp = new & {"fused_all_gather_matmul", "fused_matmul_reduce_scatter"}
    # SP pads the token count to a multiple of tp before a reduce_scatter and slices after the all_gather.
    padding = bool(added) and all(short_op(n.target) in ("constant_pad_nd", "slice") for n in (*removed, *added))
    passes = " + ".join(name for name, hit in (("SP", sp), ("AsyncTP", async_tp), ("SP padding", padding))
                        if hit) or "rewrite"
    where = " at the boundary" if boundary else ""
    return f"{passes}{where}: {counts(removed)} → {counts(added)}"


def diff_regions(before: GraphSnapshot, after: GraphSnapshot, removed: Sequence[str], added: Sequence[str], *,
                 input_names: dict[str, str] | None = None) -> tuple[DiffRegion, ...]:
    """Group the removed and added FX nodes into rewritten neighbourhoods (see the module docstring)."""
    before_by = {n.name: n for n in before.nodes}
    after_by = {n.name: n for n in after.nodes}
    every = {**before_by, **after_by}
    adj_b, adj_a = _adjacency(before), _adjacency(after)
    union: dict[str, set[str]] = defaultdict(set)
    for adj in (adj_b, adj_a):
        for k, v in adj.items():
            union[k] |= v
    # Size arithmetic and graph inputs are not drawn (piece_graph folds them), so they neither make nor join
    # regions: a weight or the token count is read all over the piece and would glue every rewrite into one.
    # The output node and other widely read nodes are hubs too.
    degree = {name: len(union[name]) for name in every}
    hubs = {name for name, n in every.items()
            if is_folded(n) or n.op in ("placeholder", "output") or degree[name] > _MAX_BRIDGE_DEGREE}
    changed = (set(removed) | set(added)) - hubs
    if not changed:
        return ()
    # Changed nodes join when adjacent or one kept node apart (SP's new norm sits between RS and AG).
    parent = {n: n for n in changed}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for n in changed:
        for m in union[n]:
            if m in hubs:
                continue
            near = {m} if m in changed else {k for k in union[m] if k in changed}
            for k in near:
                parent[find(k)] = find(n)
    order = {name: i for i, name in enumerate([*before_by, *(n for n in after_by if n not in before_by)])}
    components: dict[str, list[str]] = defaultdict(list)
    for n in sorted(changed, key=lambda n: order.get(n, 0)):
        components[find(n)].append(n)

    preds_b: dict[str, list[str]] = defaultdict(list)
    preds_a: dict[str, list[str]] = defaultdict(list)
    for a, b in before.edges:
        preds_b[b].append(a)
    for a, b in after.edges:
        preds_a[b].append(a)
    mod_b = infer_modules(before.nodes, preds_b)
    removed_nodes = [before_by[n] for n in removed if n in before_by]
    mod_a = infer_modules(after.nodes, preds_a, replaced=removed_nodes)
    regions = []
    for members in components.values():
        gone = [n for n in members if n in before_by and n not in after_by]
        new = [n for n in members if n in after_by and n not in before_by]
        # One ring of kept neighbours on each side, so the rewrite reads in its context.
        keep_b = set(gone) | {k for n in gone for k in adj_b[n]} | {k for n in new for k in adj_a[n] if k in before_by}
        keep_a = set(new) | {k for n in new for k in adj_a[n]} | {k for n in gone for k in adj_b[n] if k in after_by}
        # Named after its matmul (a rewrite is about one), else a module a node really carries before one
        # inferred for a node the passes inserted.
        nodes = [(before_by.get(n) or after_by[n], mod_b.get(n) or mod_a.get(n)) for n in (*gone, *new)]
        found = sorted(((node.kind not in ("matmul", "fused"), inferred, module) for node, (module, inferred) in nodes
                        if module), key=lambda m: m[:2])
        module = found[0][2] if found else None
        # A rewrite whose result leaves the piece is the boundary policy's (e.g. the re-gather of "gather").
        boundary = any(after_by[k].op == "output" for n in new for k in adj_a[n] if k in after_by)
        regions.append(DiffRegion(
            index=len(regions), title=_title([before_by[n] for n in gone], [after_by[n] for n in new],
                                             boundary=boundary),
            module=module, removed=tuple(gone), added=tuple(new),
            before=collapse(before, gone, keep=keep_b, modules=mod_b, input_names=input_names),
            after=collapse(after, new, keep=keep_a, modules=mod_a, input_names=input_names)))
    return tuple(regions)


def piece_diff_data(report: ReportSource, range_index: int | None = None, piece_index: int = 0) -> PieceDiffData:
    """The graph of one piece before and after the passes, collapsed for drawing, with the rewritten regions."""
    report = as_report(report)
    ri = resolve_range(report, range_index)
    rng = report.ranges[ri]
    if not rng.pieces:
        why = "its compile failed" if rng.failures else "it was not compiled"
        raise IndexError(f"range {ri} (tokens {rng.lo}-{rng.hi}) has no pieces: {why}; run a token count in it "
                         f"first or pick another range_index")
    match = [p for p in rng.pieces if p.index == piece_index]
    if not match:
        raise IndexError(f"piece_index={piece_index} not in range {ri} (pieces 0-{len(rng.pieces) - 1})")
    raw = match[0]
    before_g = raw.graph_before or GraphSnapshot()
    after_g = raw.graph_after or before_g
    before_names = [n.name for n in before_g.nodes]
    after_names = {n.name for n in after_g.nodes}
    known_before = set(before_names)
    # The compiler lists what it added; anything else absent from the before-graph was added too.
    added = tuple(dict.fromkeys([*(raw.changed or ()), *(n.name for n in after_g.nodes if n.name not in known_before)]))
    removed = tuple(n for n in before_names if n not in after_names)
    counts_before, counts_after = raw.op_counts_before or {}, raw.op_counts_after or {}
    keys = sorted(set(counts_before) | set(counts_after), key=lambda k: (k not in COLLECTIVE_KEYS, k))
    op_counts = pl.DataFrame({"op": keys, "before": [int(counts_before.get(k, 0)) for k in keys],
                              "after": [int(counts_after.get(k, 0)) for k in keys]},
                             schema={"op": pl.String, "before": pl.Int64, "after": pl.Int64}
                             ).with_columns(delta=pl.col("after") - pl.col("before"))
    overview = overview_data(report, ri)
    preds: dict[str, list[str]] = defaultdict(list)
    for a, b in after_g.edges:
        preds[b].append(a)
    removed_nodes = [n for n in before_g.nodes if n.name in set(removed)]
    after_modules = infer_modules(after_g.nodes, preds, replaced=removed_nodes)
    names = _input_names(rng, piece_index, after_g)
    return PieceDiffData(range_index=ri, range=rng, piece=overview.piece(piece_index),
                         before=collapse(before_g, removed, input_names=names),
                         after=collapse(after_g, added, modules=after_modules, input_names=names),
                         added=added, removed=removed,
                         regions=diff_regions(before_g, after_g, removed, added, input_names=names),
                         op_counts=op_counts, provenance=overview.provenance)


def _input_names(rng: RangeReport, piece_index: int, graph: GraphSnapshot) -> dict[str, str]:
    """Placeholder name -> the model's name of the boundary tensor it receives (``arg3_1`` -> ``residual``)."""
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    names = {}
    for boundary in rng.boundaries:
        for t in boundary.tensors:
            for piece, index in t.consumer_inputs:
                if piece == piece_index and 0 <= index < len(placeholders):
                    names[placeholders[index]] = t.name
    return names
