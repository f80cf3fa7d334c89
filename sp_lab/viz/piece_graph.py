"""A piece's graph as a person reads it: runs of pointwise ops collapsed, weights folded, model names on nodes.

The compiler snapshots each piece's aten graph before and after the SP and AsyncTP passes (nodes with op,
kind, shape, module, source line; edges). A decoder layer is ~100 aten nodes, most of them pointwise ops,
views and shape arithmetic; drawn as is, the few that matter (collectives, fused ops, matmuls) drown. So:

- weight inputs (all dims static) and size arithmetic (``sym_size``, ``floordiv`` on SymInts) are folded into
  the nodes that read them and listed in their hover;
- a run of pointwise ops of one module collapses into one node with a count (``pow…mul ×7``). Runs grow along
  edges whose producer has exactly one consumer, so collapsing never creates a cycle; ``wait_tensor`` folds into
  its collective and ``getitem`` into the op whose tuple it reads;
- nodes the passes inserted carry no module in their metadata; they take the module of the node they replace
  (same op, in order: SP re-creates the norm on the shard) or else of their first input, marked as inferred.

:func:`collapse` builds a :class:`PieceGraph` from a snapshot; ``piece_diff`` adds the before/after regions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from sp_lab.compiler.report import GraphSnapshot, NodeRecord

__all__ = ["KIND_PRIORITY", "GraphNode", "PieceGraph", "collapse", "infer_modules", "is_folded", "short_op"]

# When a collapsed node mixes kinds it is coloured by the most telling one.
KIND_PRIORITY = ("fused", "collective", "matmul", "norm", "split", "input", "output", "other")
_COLLAPSIBLE_KINDS = frozenset({"other", "norm"})
_SHORT = {"fused_all_gather_matmul": "AG+mm (fused)", "fused_matmul_reduce_scatter": "mm+RS (fused)",
          "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


def short_op(target: str) -> str:
    """``"aten.mm.default"`` -> ``"mm"``; ``"_c10d_functional.all_gather_into_tensor.default"`` ->
    ``"all_gather"``; fused ops get the field's shorthand (``"AG+mm (fused)"``)."""
    parts = target.split(".")
    name = parts[1] if len(parts) >= 2 else parts[0]
    return _SHORT.get(name, name)


def _module_label(module: str | None) -> str:
    return "" if module is None else module.removeprefix("model.")


@dataclass(frozen=True)
class GraphNode:
    """One drawn node: an FX node, or a run of them collapsed into one."""

    id: str
    """Name of the run's last FX node (unique in the graph)."""
    kind: str
    """collective, fused, matmul, norm, split, input, output or other (the most telling of its members)."""
    members: tuple[str, ...]
    """FX node names in graph order."""
    ops: tuple[str, ...]
    """Short op name of each member."""
    module: str | None
    """Module path of the run (``model.layers.0.mlp``); None for graph inputs and outputs."""
    module_inferred: bool
    """True when the passes inserted the node and its module was inferred (see the module docstring)."""
    shape: tuple
    """Output shape of the run's last node."""
    dtype: str | None
    """Its dtype."""
    sources: tuple[str, ...]
    """Distinct source lines (``"layers.py:57  return F.linear(x, w)"``) of the members, in order."""
    reads: tuple[str, ...]
    """Folded inputs the run reads: weights (``"arg3_1 [64, 96]"``) and size arithmetic."""
    changed: bool
    """True when the passes added (after-graph) or removed (before-graph) any member."""

    @property
    def count(self) -> int:
        """Number of FX nodes in the run."""
        return len(self.members)

    @property
    def op_text(self) -> str:
        """``"mm"``, or ``"pow…mul ×7"`` for a run (a collective with its ``wait_tensor`` reads as the collective)."""
        if self.count == 1 or (self.count == 2 and self.ops[1] == "wait_tensor" and self.kind == "collective"):
            return self.ops[0]
        return f"{self.ops[0]}…{self.ops[-1]} ×{self.count}"

    @property
    def label(self) -> str:
        """``op · module · shape`` (module without the ``model.`` prefix, ``~`` when inferred)."""
        module = _module_label(self.module)
        if module and self.module_inferred:
            module = "~" + module
        parts = [self.op_text, module, _shape_text(self.shape) if self.shape else ""]
        return " · ".join(p for p in parts if p)


@dataclass(frozen=True)
class PieceGraph:
    """A piece graph ready to lay out: collapsed nodes and the edges between them."""

    nodes: tuple[GraphNode, ...]
    """Nodes in graph order of their last member."""
    edges: tuple[tuple[str, str], ...]
    """(producer id, consumer id), no duplicates, no self-loops."""

    @cached_property
    def _owner(self) -> dict[str, str]:
        return {m: n.id for n in self.nodes for m in n.members}

    def node_of(self, fx_name: str) -> str | None:
        """Id of the drawn node that holds FX node ``fx_name`` (None when folded away or absent)."""
        return self._owner.get(fx_name)

    def search(self, query: str) -> tuple[str, ...]:
        """Ids of the nodes whose op, module or FX name contains ``query`` (case-insensitive)."""
        q = query.strip().lower()
        if not q:
            return ()
        return tuple(n.id for n in self.nodes
                     if any(q in s.lower() for s in (*n.ops, *n.members, n.module or "")))

    def by_kind(self) -> dict[str, int]:
        """Drawn-node count per kind."""
        counts: dict[str, int] = defaultdict(int)
        for n in self.nodes:
            counts[n.kind] += 1
        return dict(counts)


def is_folded(node: NodeRecord) -> bool:
    """Weights (placeholders with only static dims) and SymInt arithmetic: read by nodes, not drawn."""
    if node.op == "placeholder":
        return node.shape is None or all(isinstance(d, int) for d in node.shape)
    if node.op != "call_function" or node.shape is not None:
        return False
    target = str(node.target)
    # sym_size / sym_numel and Python operators on SymInts; getitem of a tuple is kept (it is a tensor's path).
    return "sym_" in target or ("." not in target and target != "getitem")


def infer_modules(nodes: Sequence[NodeRecord], preds: Mapping[str, Sequence[str]],
                  replaced: Sequence[NodeRecord] = ()) -> dict[str, tuple[str | None, bool]]:
    """Module of every node: its own, else that of the removed node of the same op it replaces (in order),
    else its first input's. Returns name -> (module, inferred)."""
    pool: dict[str, list[str]] = defaultdict(list)
    for r in replaced:
        # Only pointwise and norm ops are re-created one for one (SP's norm on the shard); a new collective or
        # wait_tensor has nothing to do with the one it replaced.
        if r.module and r.kind in _COLLAPSIBLE_KINDS:
            pool[r.target].append(r.module)
    out: dict[str, tuple[str | None, bool]] = {}
    for n in nodes:
        if n.module or n.op != "call_function":
            out[n.name] = (n.module, False)
        elif pool.get(n.target):
            out[n.name] = (pool[n.target].pop(0), True)
        else:
            # An input with a module of its own beats an inferred one; a matmul (plain or fused) takes its
            # weight's, the last operand (mm(A, B), fused_all_gather_matmul(A, [B])), whose permute names the layer.
            known = [out[p] for p in preds.get(n.name, ()) if out.get(p, (None,))[0]]
            if n.kind in ("matmul", "fused"):
                known.reverse()
            inherited = next((m for m, inferred in known if not inferred), known[0][0] if known else None)
            out[n.name] = (inherited, inherited is not None)
    return out


def collapse(snapshot: GraphSnapshot, changed: Iterable[str] = (), *, keep: Iterable[str] | None = None,
             modules: Mapping[str, tuple[str | None, bool]] | None = None,
             input_names: Mapping[str, str] | None = None) -> PieceGraph:
    """Collapse a graph snapshot (``.nodes``, ``.edges``) into a :class:`PieceGraph`.

    ``changed``: FX names the passes added or removed (their runs are marked). ``keep``: draw only these FX
    names (a diff region's neighbourhood). ``modules``: precomputed :func:`infer_modules` of the whole graph.
    ``input_names``: the model's name for a graph input that crossed a boundary (``arg3_1`` -> ``residual``),
    shown instead of the FX name.
    """
    by_name = {n.name: n for n in snapshot.nodes}
    preds: dict[str, list[str]] = defaultdict(list)
    succs: dict[str, list[str]] = defaultdict(list)
    for a, b in snapshot.edges:
        if a in by_name and b in by_name:
            preds[b].append(a)
            succs[a].append(b)
    if modules is None:
        modules = infer_modules(snapshot.nodes, preds)
    kept = set(by_name) if keep is None else set(keep) & set(by_name)
    folded = {n.name for n in snapshot.nodes if is_folded(n)}
    drawn = [n for n in snapshot.nodes if n.name in kept and n.name not in folded]
    drawn_names = {n.name for n in drawn}

    parent = {n.name: n.name for n in drawn}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def collapsible(n: NodeRecord) -> bool:
        return n.op == "call_function" and n.kind in _COLLAPSIBLE_KINDS

    single_consumer_merges, single_producer_merges = [], []
    for n in drawn:
        outs = [s for s in succs[n.name] if s in drawn_names]
        if len(succs[n.name]) == 1 and len(outs) == 1:
            v = by_name[outs[0]]
            same_module = modules[n.name][0] == modules[v.name][0]
            if (collapsible(n) and collapsible(v) and same_module) or (
                    n.kind == "collective" and "wait_tensor" in str(v.target)):
                single_consumer_merges.append((n.name, v.name))
        ins = [p for p in preds[n.name] if p in drawn_names]
        if str(n.target) == "getitem" and len(preds[n.name]) == 1 and len(ins) == 1:
            single_producer_merges.append((n.name, ins[0]))
    # Merging along an edge whose producer has one consumer (or whose consumer has one producer) cannot make a
    # cycle on its own; mixing both kinds can, so the second kind is undone if the result is not a DAG.
    for merges in (single_consumer_merges, single_producer_merges):
        for a, b in merges:
            parent[find(a)] = find(b)
    groups = _groups(drawn, find)
    edges = _group_edges(drawn, preds, drawn_names, find)
    if not _is_dag(groups, edges):
        parent = {n.name: n.name for n in drawn}
        for a, b in single_consumer_merges:
            parent[find(a)] = find(b)
        groups = _groups(drawn, find)
        edges = _group_edges(drawn, preds, drawn_names, find)

    changed = set(changed)
    nodes = []
    for root, members in groups.items():
        last = members[-1]
        # The module of the run's most telling member: a folded wait_tensor must not name the collective.
        lead = min(members, key=lambda m: KIND_PRIORITY.index(m.kind) if m.kind in KIND_PRIORITY else 99)
        module, inferred = modules[lead.name]
        reads = [f"{p} {_shape_text(by_name[p].shape)}" for m in members for p in preds[m.name] if p in folded]
        sources = tuple(dict.fromkeys(m.source for m in members if m.source))
        kind = min((m.kind for m in members), key=lambda k: KIND_PRIORITY.index(k) if k in KIND_PRIORITY else 99)
        nodes.append(GraphNode(
            id=root, kind=kind, members=tuple(m.name for m in members),
            ops=tuple((input_names or {}).get(m.name) or short_op(m.target) for m in members),
            module=module, module_inferred=inferred, shape=tuple(last.shape or ()), dtype=last.dtype,
            sources=sources, reads=tuple(dict.fromkeys(reads)), changed=any(m.name in changed for m in members)))
    return PieceGraph(nodes=tuple(nodes), edges=tuple(edges))


def _shape_text(shape: Any) -> str:
    from sp_lab.viz.overview import format_shape

    return "(size)" if shape is None else format_shape(shape)


def _groups(drawn: Sequence[NodeRecord], find) -> dict[str, list[NodeRecord]]:
    groups: dict[str, list[Any]] = {}
    for n in drawn:
        groups.setdefault(find(n.name), []).append(n)
    # Id = the run's last member, so a node keeps its id whether or not anything collapsed into it.
    return {members[-1].name: members for members in groups.values()}


def _group_edges(drawn: Sequence[NodeRecord], preds: Mapping[str, Sequence[str]], drawn_names: set[str],
                 find) -> list[tuple[str, str]]:
    last_of: dict[str, str] = {}
    for n in drawn:
        last_of[find(n.name)] = n.name
    edges = []
    for n in drawn:
        for p in preds[n.name]:
            if p in drawn_names:
                a, b = last_of[find(p)], last_of[find(n.name)]
                if a != b:
                    edges.append((a, b))
    return list(dict.fromkeys(edges))


def _is_dag(groups: Mapping[str, Any], edges: Sequence[tuple[str, str]]) -> bool:
    indegree = dict.fromkeys(groups, 0)
    succs: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        indegree[b] += 1
        succs[a].append(b)
    ready = [g for g, d in indegree.items() if d == 0]
    seen = 0
    while ready:
        g = ready.pop()
        seen += 1
        for s in succs[g]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    return seen == len(groups)
