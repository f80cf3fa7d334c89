"""Sequence parallelism: ``all_reduce -> (residual add) -> norm`` becomes
``reduce_scatter -> add + norm on the token shard -> all_gather``.

Why a graph walk and not Inductor's pattern matcher: SP is not a fixed sub-graph. What runs on the shard is
the whole run of *token-local* ops between the reduction and the next matmul: the residual add, any RMSNorm
spelling (``F.rms_norm``, the hand-written ``x * rsqrt(mean(x**2))``, fp32 up-casts in bf16 models), LayerNorm,
a scale. A pattern per spelling and dtype would miss user code; the walk instead propagates the sharded
layout through every op that is pointwise or reduces only non-token dims (``torch.Tag.pointwise`` and a short
list of reductions), and materialises the full tensor with an all_gather right before the first consumer that
needs every token (a matmul, attention, a graph output). The fusions that *are* fixed sub-graphs
(all_gather -> mm, mm -> reduce_scatter) use the pattern matcher, in ``async_tp.py``.

Shapes: a token count ``N`` that is not a multiple of ``tp`` is padded with zero rows before the
reduce_scatter, every shard is ``[c, ...]`` with ``c = ceil(N / tp)``, and gathered tensors are sliced back
to ``N`` rows (after the matmul when a matmul consumes them, so that the all_gather -> mm pair stays fusable).

Layouts: a batch of ``B`` sequences of ``S`` tokens holds ``N = B * S`` tokens (``B`` is static, ``S`` the
symbolic token count; ``B = 1`` for sp_lab's models). The token rows of a tensor are its leading dimensions
up to the first one at which their product reaches ``N``: ``[N, H]`` (sp_lab's models), ``[1, S, H]``
(torchtitan and Hugging Face models at batch 1), ``[B, S, H]`` and ``[B * S, H]`` are all ``N`` rows of
``H``. As vLLM does with flattened tokens, SP shards those ``N`` rows, whatever the batch: collectives work on
dim 0 of the ``[N, ...]`` view, a shard is ``[c, ...]`` with the leading dimensions kept as size 1
(``[1, c, H]`` for a ``[B, S, H]`` value, so the op's dimension numbers and broadcasting still hold), and a
gathered value is viewed back to ``[B, S, ...]``. Views keep each token's row (reshape preserves row-major
order) when they change only the leading dimensions or only the rest (``[B, S, H] <-> [B * S, H]``,
``[N, H] <-> [N, heads, d]``), so they carry the shard. Which dimension of the *model input* holds the tokens
is ``token_dim`` (LabConfig); the pass reads ``B`` and ``S`` off the shapes.

Forms (as vLLM named them), recorded per rewrite: ``first`` (the residual enters full, e.g. after the
embedding or at a piece boundary), ``middle`` (joins the sharded residual of an earlier rewrite and is joined
by a later one), ``last`` (joins an earlier residual; only its normed output is gathered).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from sp_lab.compiler.passes.boundary import BoundaryEvents, BoundaryPolicy
from sp_lab.compiler.passes.graph_builder import GraphBuilder, is_tensor_node, same_size
from sp_lab.compiler.report import CountKey, SPRewrite

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

__all__ = ["TOKEN_LOCAL_REDUCTIONS", "TOKEN_SHARD", "SPResult", "apply_sequence_parallel", "padded_shard_rows"]

# The meta key set on every token shard the pass leaves in the graph, its value the shards' row alignment (1, or
# 4: see _row_align): where SP runs before splitting, the boundary records read it (a shard's shape alone can be
# mistaken: [1, S, H] at B = tp is also [S, H]-like) and size the shard with padded_shard_rows.
TOKEN_SHARD = "sp_lab_token_shard"


def padded_shard_rows(tokens: Any, tp: int, row_align: int) -> Any:
    """Rows of each rank's shard of ``tokens`` rows when ``tp * row_align`` does not divide them: shards of a
    multiple of ``row_align`` rows, zero-padded (where it divides, a shard is ``tokens // tp``). An int or a
    SymInt; the pass builds the same sizes into the graph (``_Rewriter``'s ``chunk``)."""
    align = tp * row_align
    return (tokens + align - 1) // align * row_align

# Reductions that stay inside one token's row when they reduce only dimensions after the token rows (or size-1 ones
# among them): ``_Rewriter._token_local`` checks which.
TOKEN_LOCAL_REDUCTIONS = {
    aten.mean.dim,
    aten.sum.dim_IntList,
    aten.amax.default,
    aten.amin.default,
    aten.var.correction,
    aten.var_mean.correction,
    aten.prod.dim_int,
}
# Non-pointwise ops that act row by row.
TOKEN_LOCAL_OTHER = {aten._to_copy.default, aten.clone.default, aten.alias.default}
# Views that are token-local when they keep each token's row (checked on the shapes).
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# Matmuls whose token-major operand gets its own all_gather (a fusable pair), by the index of that operand.
# ``_scaled_mm``'s per-token scale (argument 2, ``[N, 1]``) travels with its rows; a tensorwise scale is not
# token-major and stays as it is.
MATMUL_ROWS = {aten.mm.default: 0, aten.addmm.default: 1, aten._scaled_mm.default: 0}
_ROW_SCALE = 2


@dataclass
class SPResult:
    """What the SP rewrite did to one graph."""

    rewrites: list[SPRewrite] = field(default_factory=list)
    boundary: BoundaryEvents = field(default_factory=BoundaryEvents)

    def count(self, form: str) -> int:
        return sum(r.form == form for r in self.rewrites)

    def matches(self) -> dict[CountKey, int]:
        """The report's match counts of this rewrite: the sites by form, and what the boundary policy gathered
        (outputs and in-place copies) or erased."""
        counts = {CountKey(f"sp_{form}"): self.count(form) for form in ("first", "middle", "last")}
        gathered = len(self.boundary.gathered_outputs) + len(self.boundary.copies_by("gathered"))
        counts[CountKey.BOUNDARY_GATHER] = gathered
        counts[CountKey.BOUNDARY_ERASE] = len(self.boundary.copies_by("erased"))
        return counts


def _is_sp_site(node: fx.Node, group_name: str | None) -> bool:
    """A summing all_reduce of a token-major tensor whose only user is its wait."""
    if node.target is not c10d.all_reduce.default or node.args[1] != "sum":
        return False
    if group_name is not None and node.args[2] != group_name:
        return False
    users = list(node.users)
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return (
        len(users) == 1
        and users[0].target is c10d.wait_tensor.default
        and isinstance(val, torch.Tensor)
        and val.dim() >= 2
    )


def _row_align(graph: fx.Graph) -> int:
    """Rows every token shard is made a multiple of: 4 where a scaled matmul takes per-token scales, else 1.

    cuBLAS's row-wise FP8 kernel wants each scale pointer 16-byte aligned; a fused all_gather + scaled matmul
    hands it one rank's chunk of the gathered ``[N, 1]`` float32 scales at byte offset ``4 * rows * rank``,
    so shards of 4k rows keep every chunk aligned (measured on an H200: chunks of 1-2 rows fail with
    CUBLAS_STATUS_NOT_SUPPORTED). The extra rows are zero padding, as for a count tp does not divide.
    """
    rowwise = any(n.target is aten._scaled_mm.default and is_tensor_node(n.args[_ROW_SCALE])
                  and n.args[_ROW_SCALE].meta["val"].dim() == 2 for n in graph.nodes)
    return 4 if rowwise else 1


class _Rewriter:
    def __init__(self, graph: fx.Graph, tp_size: int, rank: int, group_name: str | None, policy: BoundaryPolicy,
                 token_dim: int = 0):
        self.graph, self.tp, self.rank, self.policy = graph, tp_size, rank, policy
        self.group_name = group_name
        self.token_dim = token_dim
        self.b = GraphBuilder(graph)
        self.result = SPResult()
        self.shard: dict[fx.Node, fx.Node] = {}  # original full value -> its token shard
        self.lineage: dict[fx.Node, frozenset[int]] = {}  # shard origin: indices of SP rewrites
        self.full_cache: dict[fx.Node, fx.Node] = {}
        self.shard_cache: dict[fx.Node, fx.Node] = {}
        self.joined_earlier: set[int] = set()
        self.joined_later: set[int] = set()

    # -- sizes -------------------------------------------------------------------------------------------------
    def _token_count(self, site_input: fx.Node) -> tuple[Any, int] | None:
        """``(N, B)``: the token rows of the first SP site's input and the static batch they hold.

        Symbolic: ``N`` is the product of the leading dimensions up to the first symbolic one (``[B, S, H]``
        and ``[B * S, H]`` both give ``B * S``) and must be ``B * S`` for one symbol ``S`` (else None: no SP).
        Static (a graph traced for one count: a model that makes Dynamo specialise it, or a hand-traced graph):
        dim 0 when tokens are dim 0 of the model input, otherwise the first dimension that is not 1, as one batch.
        """
        val = site_input.meta["val"]
        first_symbolic = next((d for d, size in enumerate(val.shape) if not isinstance(size, int)), None)
        if first_symbolic is None:
            if self.token_dim == 0:
                return val.shape[0], 1
            return next((d for d in val.shape if not (isinstance(d, int) and d == 1)), val.shape[0]), 1
        tokens = math.prod(val.shape[: first_symbolic + 1])
        expr = tokens.node.expr
        if len(expr.free_symbols) != 1:
            return None
        batch = expr / next(iter(expr.free_symbols))
        return (tokens, int(batch)) if batch.is_Integer and batch > 0 else None

    def _setup_sizes(self, first_input: fx.Node) -> bool:
        counted = self._token_count(first_input)
        if counted is None:
            return False
        self.tokens_val, self.batch = counted
        if isinstance(self.tokens_val, int):
            # A static graph (traced for one count, e.g. one token): every size is a Python int that
            # GraphBuilder.sym folds, so nothing is read off a graph input. (Reading it would not work at one
            # token either: every size-1 dimension then "holds the tokens".)
            self._set_sizes(self.tokens_val, "tokens")
            return True
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        # Read the token count off a graph input, so the size arithmetic precedes every rewrite point and
        # adds no user to the nodes being rewritten.
        source, dim = first_input, self._tdim(first_input.meta["val"])
        for p in placeholders:
            if isinstance(p.meta.get("val"), torch.SymInt) and self._size_kind(p.meta["val"]) is not None:
                source, dim = p, None
                break
            if is_tensor_node(p) and self._tdim(p.meta["val"]) is not None:
                source, dim = p, self._tdim(p.meta["val"])
                break
        anchor = placeholders[-1] if source.op == "placeholder" else source
        with self.graph.inserting_before(anchor.next):
            size = source if dim is None else self.b.size(source, dim)
            size_val = source.meta["val"] if dim is None else source.meta["val"].shape[dim]
            self._set_sizes(size, self._size_kind(size_val))
        return True

    def _set_sizes(self, size: Any, kind: str | None) -> None:
        """Token count, sequence length, shard size, padding and this rank's offset, from ``size``: all ``N``
        tokens (``kind == "tokens"``) or one sequence's ``S``. Built at the graph's current insertion point."""
        if kind == "tokens":
            self.tokens = size
            self.seq = self.b.sym(operator.floordiv, size, self.batch) if self.batch > 1 else size
        else:  # the sequence length S of a [B, S, ...] tensor
            self.seq = size
            self.tokens = self.b.sym(operator.mul, size, self.batch) if self.batch > 1 else size
        # Shards of row_align rows: see _row_align.
        align = self.tp * self.row_align
        self.needs_pad = not same_size(self.tokens_val % align, 0)
        chunk = self.b.sym(operator.floordiv, self.b.sym(operator.add, self.tokens, align - 1), align)
        chunk = self.b.sym(operator.mul, chunk, self.row_align) if self.row_align > 1 else chunk
        self.chunk = chunk if self.needs_pad else self.b.sym(operator.floordiv, self.tokens, self.tp)
        self.pad = self.b.sym(operator.sub, self.b.sym(operator.mul, self.chunk, self.tp), self.tokens)
        self.offset = self.b.sym(operator.mul, self.chunk, self.rank)

    def _size_kind(self, size: Any) -> str | None:
        """What a dimension's size is in token terms: all ``N`` tokens, one sequence's ``S``, or neither."""
        if same_size(size, self.tokens_val):
            return "tokens"
        if self.batch > 1 and same_size(size * self.batch, self.tokens_val):
            return "seq"
        return None

    def _tdim(self, val: Any) -> int | None:
        """The last of a value's token-row dimensions: the leading dimensions whose sizes multiply to ``N``
        (``[N, H]``: 0; ``[1, S, H]`` and ``[B, S, H]``: 1). Each must be static or ``S`` or ``N``."""
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            return None
        if same_size(self.tokens_val, 1):
            # One token in a static graph: every size-1 dimension multiplies to N. The rows end where
            # they would for N > 1: at the model's token_dim, before the last (feature) dimension, and within
            # the leading size-1 dimensions.
            ones = next((d for d, size in enumerate(val.shape) if not same_size(size, 1)), val.dim())
            return min(self.token_dim, max(val.dim() - 2, 0), ones - 1) if ones > 0 else None
        rows: Any = 1
        for d, size in enumerate(val.shape):
            if not isinstance(size, int) and self._size_kind(size) is None:
                return None
            rows = rows * size
            if same_size(rows, self.tokens_val):
                return d
        return None

    def _prefix(self, val: torch.Tensor, t: int) -> list[Any]:
        """The sizes of ``val``'s token-row dimensions ``0..t`` as reshape arguments (ints or size nodes)."""
        kinds = {"tokens": self.tokens, "seq": self.seq}
        return [size if isinstance(size, int) else kinds[self._size_kind(size)] for size in val.shape[: t + 1]]

    def _rows_only(self, val: torch.Tensor, t: int) -> bool:
        """Whether dimension ``t`` alone holds the ``N`` rows (every earlier one is 1): no reshape needed."""
        return all(isinstance(size, int) and size == 1 for size in val.shape[:t])

    def _right(self, node: fx.Node) -> int | None:
        """Where the token dimension sits counted from the right (what broadcasting aligns)."""
        val = node.meta.get("val")
        d = self._tdim(val)
        return None if d is None else val.dim() - d

    def _token_aligned(self, arg: object, out_right: int) -> bool:
        return is_tensor_node(arg) and self._right(arg) == out_right

    def _rest(self, node: fx.Node, dim: int) -> list[Any]:
        """The sizes after ``dim`` (ints, or sym_size nodes)."""
        return [self.b.size(node, d) for d in range(dim + 1, node.meta["val"].dim())]

    def _padded(self, node: fx.Node, dim: int = 0) -> fx.Node:
        return self.b.pad_rows(node, self.pad, dim) if self.needs_pad else node

    def _padded_scale(self, scale: fx.Node) -> fx.Node:
        """A per-token scale ``[N, 1]`` padded as ``[N]`` and viewed back with explicit strides ``(1, 1)``:
        Inductor is free to lay out a size-1 dimension with any stride (it chose ``N + p`` and ``0``), and
        ``_scaled_mm`` refuses a row-wise scale whose ``stride(1) != 1``; ``as_strided`` pins the layout."""
        if not self.needs_pad:
            return scale
        flat = self.b.pad_rows(self.b.view(scale, [self.tokens]), self.pad)
        return self.b.call(aten.as_strided.default, flat, [self.b.sym(operator.add, self.tokens, self.pad), 1], [1, 1])

    def _full(self, node: fx.Node) -> fx.Node:
        """The full value of a sharded node (one all_gather per node, inserted at first need), in the node's
        own layout (``[B, S, ...]`` again for a batched value)."""
        if node not in self.full_cache:
            shard = self.shard[node]
            t = self._tdim(node.meta["val"])
            flat = shard if t == 0 else self.b.view(shard, [self.chunk, *self._rest(shard, t)])
            gathered = self.b.all_gather(flat, self.tp, self.group_name)
            full = self.b.narrow_rows(gathered, 0, self.tokens) if self.needs_pad else gathered
            if t != 0:
                full = self.b.view(full, [*self._prefix(node.meta["val"], t), *self._rest(shard, t)])
            self.full_cache[node] = full
        return self.full_cache[node]

    def _shard_of_full(self, node: fx.Node) -> fx.Node:
        """This rank's rows of a full token-major tensor (e.g. a residual that enters a piece full)."""
        if node not in self.shard_cache:
            t = self._tdim(node.meta["val"])
            if self._rows_only(node.meta["val"], t):
                shard = self.b.narrow_rows(self._padded(node, t), self.offset, self.chunk, t)
            else:  # [B, S, ...]: this rank's rows of the flattened [B * S, ...] view
                rest = self._rest(node, t)
                flat = self._padded(self.b.view(node, [self.tokens, *rest]))
                shard = self.b.view(self.b.narrow_rows(flat, self.offset, self.chunk), [1] * t + [self.chunk, *rest])
            self.shard_cache[node] = shard
        return self.shard_cache[node]

    # -- classification ------------------------------------------------------------------------------------------
    def _token_local(self, node: fx.Node) -> bool:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            return False
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor) or self._tdim(out) is None:
            return False
        if target in VIEWS:
            (src,) = [a for a in node.all_input_nodes if a in self.shard]
            t_in, t_out = self._tdim(src.meta["val"]), self._tdim(out)
            return t_in is not None and same_size(
                math.prod(src.meta["val"].shape[t_in + 1:]), math.prod(out.shape[t_out + 1:]))
        t = self._tdim(out)
        right = out.dim() - t
        for a in node.all_input_nodes:
            if a in self.shard or self._token_aligned(a, right) or not is_tensor_node(a):
                if a in self.shard and self._right(a) != right:
                    return False
                continue
            # A full operand that is not token-major must broadcast over the token rows (a weight [H], a
            # scalar); one that varies along them otherwise ([S, H] added to [B, S, H]) needs every token.
            val = a.meta["val"]
            offset = out.dim() - val.dim()
            if any(d - offset >= 0 and not (isinstance(val.shape[d - offset], int) and val.shape[d - offset] == 1)
                   for d in range(t + 1)):
                return False
        if torch.Tag.pointwise in target.tags or target in TOKEN_LOCAL_OTHER:
            return True
        if target in TOKEN_LOCAL_REDUCTIONS:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            source = node.args[0].meta["val"]
            token = self._tdim(source)
            # Token-local when it reduces only dimensions after the token rows, or size-1 ones among them.
            return dims is not None and token is not None and all(
                d % source.dim() > token or (d % source.dim() < token and source.shape[d % source.dim()] == 1)
                for d in ([dims] if isinstance(dims, int) else dims))
        return False

    def _row_operands(self, matmul: fx.Node) -> list[int]:
        """The argument indices of a matmul that hold its token rows: A, and a scaled matmul's per-token
        scale ``[N, 1]`` (a tensorwise ``[]`` scale holds no rows)."""
        rows = [MATMUL_ROWS[matmul.target]]
        if matmul.target is aten._scaled_mm.default:
            scale = matmul.args[_ROW_SCALE]
            if is_tensor_node(scale) and scale.meta["val"].dim() == 2 and self._tdim(scale.meta["val"]) == 0:
                rows.append(_ROW_SCALE)
        return rows

    # -- rewrites ------------------------------------------------------------------------------------------------
    def _rewrite_site(self, wait: fx.Node, index: int) -> None:
        all_reduce = wait.args[0]
        x = all_reduce.args[0]
        t = self._tdim(x.meta["val"])
        flat = x
        if (x.target in VIEWS and len(x.users) == 1 and is_tensor_node(x.args[0])
                and x.args[0].target in MATMUL_ROWS and self._tdim(x.args[0].meta["val"]) == 0):
            # F.linear on [B, S, H] (or [B, 1, H] at one token a sequence): reduce-scatter the mm's [N, H]
            # output itself, so that mm -> reduce_scatter is a fusable pair.
            flat = x.args[0]
        with self.graph.inserting_before(wait), self.b.standing_for(wait):
            if flat.target in MATMUL_ROWS and len(flat.users) == 1 and self.needs_pad:
                # Pad the matmul's rows instead of its output so that mm -> reduce_scatter stays fusable.
                with self.graph.inserting_before(flat):
                    args = list(flat.args)
                    for i in self._row_operands(flat):
                        args[i] = self._padded(flat.args[i]) if i != _ROW_SCALE else self._padded_scale(flat.args[i])
                    to_scatter = self.b.call(flat.target, *args, **flat.kwargs)
            else:
                if self._tdim(flat.meta["val"]) != 0:
                    flat = self.b.view(flat, [self.tokens, *self._rest(flat, t)])
                to_scatter = self._padded(flat)
            shard = self.b.reduce_scatter(to_scatter, self.tp, self.group_name)
            if t or flat is not x:  # back to x's layout: [1.., c, ...] (see the module docstring)
                shard = self.b.view(shard, [1] * t + [self.chunk, *self._rest(x, t)])
            self.shard[wait] = shard
        self.lineage[wait] = frozenset({index})
        self.result.rewrites.append(SPRewrite(all_reduce.name, "first"))

    def _shard_token_local(self, node: fx.Node) -> None:
        right = self._right(node)

        def to_shard(arg):
            if isinstance(arg, fx.Node) and arg in self.shard:
                return self.shard[arg]
            if self._token_aligned(arg, right):
                return self._shard_of_full(arg)
            return arg

        with self.graph.inserting_before(node), self.b.standing_for(node):
            if node.target in VIEWS:
                t = self._tdim(node.meta["val"])
                shape = [1] * t + [self.chunk, *list(node.args[1])[t + 1:]]
                src = next(a for a in node.all_input_nodes if a in self.shard)
                self.shard[node] = self.b.call(node.target, self.shard[src], shape)
            else:
                args = fx.node.map_aggregate(node.args, to_shard)
                kwargs = fx.node.map_aggregate(node.kwargs, to_shard)
                self.shard[node] = self.b.call(node.target, *args, **kwargs)
        origins = [self.lineage[a] for a in node.all_input_nodes if a in self.lineage]
        merged = frozenset().union(*origins)
        if len(merged) > 1:
            newest = max(merged)
            self.joined_earlier.add(newest)
            self.joined_later.update(i for i in merged if i != newest)
        self.lineage[node] = merged

    def _rewrite_consumer(self, node: fx.Node) -> None:
        with self.graph.inserting_before(node), self.b.standing_for(node):
            if node.target in MATMUL_ROWS:
                rows = self._row_operands(node)
                a = node.args[MATMUL_ROWS[node.target]]
                if (a in self.shard and self._tdim(a.meta["val"]) == 0
                        and all(node.args[i] in self.shard for i in rows)
                        and not any(x in self.shard for i, x in enumerate(node.args) if i not in rows)):
                    # Own all_gather per matmul, sliced after the matmul: all_gather -> mm is a fusable pair.
                    # A scaled matmul's FP8 rows and their per-token scales are gathered as they are: the
                    # 1-byte values, not the bf16 activations they were quantised from.
                    args = list(node.args)
                    for i in rows:
                        args[i] = self.b.all_gather(self.shard[node.args[i]], self.tp, self.group_name)
                    out = self.b.call(node.target, *args, **node.kwargs)
                    if self.needs_pad:
                        out = self.b.narrow_rows(out, 0, self.tokens)
                    node.replace_all_uses_with(out)
                    return
            if node.target is aten.copy_.default and node.args[1] in self.shard:
                src = node.args[1]
                self.policy.copy(node, self.shard[src], lambda: self._full(src), self.result.boundary)
                return
            for arg in node.all_input_nodes:
                if arg in self.shard:
                    node.replace_input_with(arg, self._full(arg))

    def _rewrite_output(self, node: fx.Node) -> None:
        def replace(arg):
            if isinstance(arg, fx.Node) and arg in self.shard:
                with self.graph.inserting_before(node):
                    return self.policy.output(arg, self.shard[arg], lambda: self._full(arg), self.result.boundary)
            return arg

        node.args = fx.node.map_aggregate(node.args, replace)

    def run(self) -> SPResult:
        sites = [n for n in self.graph.nodes if _is_sp_site(n, self.group_name)]
        if not sites:
            return self.result
        if self.group_name is None:
            self.group_name = sites[0].args[2]
            sites = [n for n in sites if n.args[2] == self.group_name]
        self.row_align = _row_align(self.graph)
        if not self._setup_sizes(sites[0].args[0]):
            return self.result
        site_waits = {}
        for s in sites:
            if self._tdim(s.args[0].meta["val"]) is not None:
                site_waits[next(iter(s.users))] = len(site_waits)
        for node in list(self.graph.nodes):
            if node in site_waits:
                self._rewrite_site(node, site_waits[node])
            elif node.op == "output":
                self._rewrite_output(node)
            elif any(a in self.shard for a in node.all_input_nodes):
                if self._token_local(node):
                    self._shard_token_local(node)
                else:
                    self._rewrite_consumer(node)
        self.result.rewrites = [
            dataclasses.replace(r, form="middle" if i in self.joined_later else "last") if i in self.joined_earlier else r
            for i, r in enumerate(self.result.rewrites)
        ]
        self.graph.eliminate_dead_code()
        # wait_tensor counts as side-effecting for FX's dead-code elimination: drop the replaced pairs by hand.
        for wait in site_waits:
            if not wait.users:
                all_reduce = wait.args[0]
                self.graph.erase_node(wait)
                if not all_reduce.users:
                    self.graph.erase_node(all_reduce)
        self.graph.eliminate_dead_code()
        for shard in [*self.shard.values(), *self.shard_cache.values()]:
            shard.meta[TOKEN_SHARD] = self.row_align
        return self.result


def apply_sequence_parallel(
    graph: fx.Graph, *, tp_size: int, rank: int, group_name: str | None, policy: BoundaryPolicy, token_dim: int = 0
) -> SPResult:
    """Rewrite every token-major summing all_reduce in ``graph`` into sequence-parallel form, in place.

    Args:
        graph: an aten-level FX graph whose nodes carry ``meta["val"]`` (post-grad or AOT forward graph).
        tp_size, rank: the tensor-parallel group size and this rank's index in it.
        group_name: only all_reduces on this group are rewritten (None: the group of the first one).
        policy: what to do where a sharded value leaves the graph (see ``boundary.py``).
        token_dim: the dimension of the model input that holds the tokens (1 for ``[batch=1, N, H]`` models).
    """
    if tp_size < 2:
        return SPResult()
    return _Rewriter(graph, tp_size, rank, group_name, policy, token_dim).run()
