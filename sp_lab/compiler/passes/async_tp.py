"""AsyncTP: fuse ``all_gather -> mm`` and ``mm -> reduce_scatter`` into single collective-matmul ops.

Written with Inductor's pattern matcher: both rewrites are fixed sub-graphs of the post-grad graph that the
SP rewrite leaves behind. The matmul may be ``mm``, ``addmm`` (a linear layer with a bias, Qwen2's q/k/v:
the fused all_gather + mm, then the bias added) or ``_scaled_mm`` (FP8: row-wise scales gathered with their
rows, or one tensor-wise scale; the FP8 values arrive as the bytes SP gathers them as). The gate is the pattern's ``extra_check``, which reads the matmul's real shapes
from ``node.meta["val"]``:

- per range: the pass is only installed for compile ranges at or above ``async_tp_min_tokens``;
- per matmul: ``LabConfig.heuristic`` (a :class:`~sp_lab.rules.MatmulRule`) decides with M taken at the
  low end of the range (the rule must hold for every token count the artifact serves); "unsure" -- and a
  matmul whose shapes cannot be read -- gets ``heuristic_default``.

Fused ops: on CUDA PyTorch's symmetric-memory kernels, elsewhere sp_lab's CPU ops (``fused_ops.py``).
"""

from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._inductor.pattern_matcher import (
    CallFunction,
    Ignored,
    KeywordArg,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)

import sp_lab.compiler.fused_ops  # noqa: F401  (registers torch.ops.sp_lab.fused_*)
from sp_lab.compiler.passes.graph_builder import GraphBuilder, is_tensor_node
from sp_lab.compiler.passes.sequence_parallel import MATMUL_ROWS
from sp_lab.compiler.report import FusionDecision
from sp_lab.rules import MatmulRule

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
log = logging.getLogger(__name__)

__all__ = ["AsyncTPDecisions", "apply_async_tp"]


@dataclass
class AsyncTPDecisions:
    """Every fusion candidate the gate saw, with its decision and why."""

    candidates: list[FusionDecision] = field(default_factory=list)

    def fused(self, pattern: str) -> int:
        return sum(c.pattern == pattern and c.decision == "fuse" for c in self.candidates)


@dataclass(frozen=True)
class _Gate:
    """The per-matmul decision, shared by both patterns (a fresh one per compile, holding the log)."""

    tp_size: int
    m_low: int
    rule: MatmulRule | None
    default: str
    decisions: AsyncTPDecisions

    def __call__(self, pattern: str, mm_node: fx.Node | None) -> bool:
        a_index = MATMUL_ROWS[mm_node.target] if mm_node is not None else 0
        val_a = mm_node.args[a_index].meta.get("val") if mm_node is not None else None
        val_b = mm_node.args[a_index + 1].meta.get("val") if mm_node is not None else None
        if not isinstance(val_a, torch.Tensor) or not isinstance(val_b, torch.Tensor):
            log.warning(
                "AsyncTP gate: cannot read the shapes of matmul %s (no meta['val']); applying heuristic_default=%r",
                getattr(mm_node, "name", "<unknown>"),
                self.default,
            )
            self.decisions.candidates.append(
                FusionDecision(pattern, None, None, None, self.default, "shapes unreadable: heuristic_default")
            )
            return self.default == "fuse"
        k, n = int(val_b.shape[0]), int(val_b.shape[1])
        m = self.m_low  # the artifact serves [m_low, hi]: judge the rule where fusion is least likely to pay
        if self.rule is None:
            decision, why = "fuse", "no heuristic: every matmul in the range fuses"
        else:
            answer = self.rule.decide(m, n, k, self.tp_size, dtype_bytes=val_a.dtype.itemsize)
            decision = self.default if answer == "unsure" else answer
            why = f"heuristic answered {answer!r}" + (f" -> heuristic_default {self.default!r}" if answer == "unsure" else "")
        dtype = str(val_a.dtype).removeprefix("torch.")
        self.decisions.candidates.append(FusionDecision(pattern, m, n, k, decision, why, dtype))
        return decision == "fuse"


def _mm_in_match(match: Match) -> fx.Node | None:
    return next((n for n in match.nodes if n.target in MATMUL_ROWS), None)


# ``_scaled_mm``'s arguments in schema order, so that every call spelling becomes one positional form.
_SCALED_MM_DEFAULTS = {"bias": None, "scale_result": None, "out_dtype": None, "use_fast_accum": False}


def _normalise_matmuls(graph: fx.Graph) -> dict[fx.Node, tuple[tuple, dict]]:
    """Write every ``_scaled_mm`` with its 8 arguments positional and drop ``addmm``'s unit ``beta``/``alpha``,
    so that one pattern each matches however the model spelled the call (the matcher compares arg lists).
    Returns each changed node's original ``(args, kwargs)``: Inductor's lowering expects a node it lowers to
    keep the spelling it was traced with, so the matmuls left unfused get theirs back."""
    original = {}
    for node in graph.nodes:
        if node.target in (aten._scaled_mm.default, aten.addmm.default):
            original[node] = (node.args, dict(node.kwargs))
        if node.target is aten._scaled_mm.default:
            args = list(node.args[:4]) + [
                node.args[4 + i] if 4 + i < len(node.args) else node.kwargs.get(name, default)
                for i, (name, default) in enumerate(_SCALED_MM_DEFAULTS.items())
            ]
            node.args, node.kwargs = tuple(args), {}
        elif node.target is aten.addmm.default and all(v == 1 for v in node.kwargs.values()):
            node.kwargs = {}
    return original


def _row_scale_shard(scale: fx.Node, tp_size: int, group_name: str) -> fx.Node | None:
    """The shard behind a gathered per-token scale ``wait(all_gather(shard))``, else None."""
    if scale.target is not c10d.wait_tensor.default or len(scale.users) != 1:
        return None
    gather = scale.args[0]
    if gather.target is not c10d.all_gather_into_tensor.default or list(gather.args[1:]) != [tp_size, group_name]:
        return None
    return gather.args[0]


def _scale_fusable(scale_a: object, result_scale: object, out_dtype: object, *, gathered: bool, tp_size: int,
                   group_name: str) -> bool:
    """What the fused scaled ops support: bf16-style output (``out_dtype`` set, no result scale) and an A scale
    that is tensor-wise, or row-wise and (for all_gather) gathered with its rows."""
    if result_scale is not None or out_dtype is None or not is_tensor_node(scale_a):
        return False
    if scale_a.meta["val"].dim() == 0:
        return True
    return _row_scale_shard(scale_a, tp_size, group_name) is not None if gathered else scale_a.meta["val"].dim() == 2


def _erase_if_unused(*nodes: fx.Node) -> None:
    """Erase replaced collectives in order (``wait_tensor`` is side-effecting for FX's dead-code elimination)."""
    for node in nodes:
        if not node.users:
            node.graph.erase_node(node)


def _build_patterns(tp_size: int, group_name: str, use_symm_mem: bool, gate: _Gate) -> PatternMatcherPass:
    """The fusions as graph patterns with hand-written replacements.

    ``register_graph_pattern`` rather than ``register_replacement``: the latter re-traces the replacement with
    the matched operands' fake values before ``extra_check`` runs, so a matmul whose shapes are unknown would
    crash the compile instead of reaching the gate's "unreadable -> heuristic_default" branch.
    """
    patterns = PatternMatcherPass(pass_name="sp_lab_async_tp")

    def gathered(a: object) -> CallFunction:
        return CallFunction(c10d.wait_tensor.default,
                            CallFunction(c10d.all_gather_into_tensor.default, a, tp_size, group_name))

    # FP8 shards cross as bytes (graph_builder.GraphBuilder.all_gather): view(uint8) -> gather -> view(fp8).
    gathered_fp8 = CallFunction(aten.view.dtype, gathered(CallFunction(aten.view.dtype, KeywordArg("a"), Ignored())),
                                Ignored())

    def scattered(x: CallFunction) -> CallFunction:
        return CallFunction(c10d.wait_tensor.default,
                            CallFunction(c10d.reduce_scatter_tensor.default, x, "sum", tp_size, group_name))

    scaled_tail = (KeywordArg("b"), KeywordArg("scale_a"), KeywordArg("scale_b"), KeywordArg("bias"),
                   KeywordArg("result_scale"), KeywordArg("out_dtype"), KeywordArg("fast_accum"))

    def emit_all_gather_matmul(build: GraphBuilder, a: fx.Node, b: fx.Node, bias: fx.Node | None = None) -> fx.Node:
        if use_symm_mem:
            fused = build.call(torch.ops.symm_mem.fused_all_gather_matmul.default, a, [b], 0, group_name)
            out = build.call(operator.getitem, build.call(operator.getitem, fused, 1), 0)
        else:
            out = build.call(torch.ops.sp_lab.fused_all_gather_matmul.default, a, b, group_name, tp_size)
        return out if bias is None else build.call(aten.add.Tensor, out, bias)

    def emit_all_gather_scaled_matmul(build: GraphBuilder, a, b, scale_a, scale_b, bias, out_dtype, fast_accum,
                                      **_) -> fx.Node:
        # A row-wise scale reaches the fused op as this rank's [c, 1] shard; its own gather is then dead.
        shard_scale = _row_scale_shard(scale_a, tp_size, group_name) if scale_a.meta["val"].dim() else None
        a_scale = shard_scale if shard_scale is not None else scale_a
        if use_symm_mem:
            fused = build.call(torch.ops.symm_mem.fused_all_gather_scaled_matmul.default, a, [b], a_scale, [scale_b],
                               0, group_name, [bias], [None], [out_dtype], [fast_accum])
            return build.call(operator.getitem, build.call(operator.getitem, fused, 1), 0)
        return build.call(torch.ops.sp_lab.fused_all_gather_scaled_matmul.default, a, b, a_scale, scale_b, bias,
                          out_dtype, group_name, tp_size)

    def emit_matmul_reduce_scatter(build: GraphBuilder, a: fx.Node, b: fx.Node) -> fx.Node:
        if use_symm_mem:
            return build.call(torch.ops.symm_mem.fused_matmul_reduce_scatter.default, a, b, "sum", 0, group_name)
        return build.call(torch.ops.sp_lab.fused_matmul_reduce_scatter.default, a, b, group_name, tp_size)

    def emit_scaled_matmul_reduce_scatter(build: GraphBuilder, a, b, scale_a, scale_b, out_dtype, fast_accum,
                                          **_) -> fx.Node:
        if use_symm_mem:
            shape = [build.size(a, 0), build.size(b, 1)]
            return build.call(torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter.default, a, b, scale_a, scale_b,
                              "sum", 0, 0, group_name, shape, None, None, out_dtype, fast_accum)
        return build.call(torch.ops.sp_lab.fused_scaled_matmul_reduce_scatter.default, a, b, scale_a, scale_b,
                          out_dtype, group_name, tp_size)

    def scaled_ok(gathered_rows: bool):
        def check(m: Match) -> bool:
            kw = m.kwargs
            if gathered_rows is False and kw["bias"] is not None:
                return False  # a bias before the reduce-scatter would be summed tp times: no model does that
            return _scale_fusable(kw["scale_a"], kw["result_scale"], kw["out_dtype"], gathered=gathered_rows,
                                  tp_size=tp_size, group_name=group_name)
        return check

    always = lambda m: True
    for pattern, name, emit, fits in (
        (CallFunction(aten.mm.default, gathered(KeywordArg("a")), KeywordArg("b")),
         "all_gather_matmul", emit_all_gather_matmul, always),
        (CallFunction(aten.addmm.default, KeywordArg("bias"), gathered(KeywordArg("a")), KeywordArg("b")),
         "all_gather_matmul", emit_all_gather_matmul, always),
        (CallFunction(aten._scaled_mm.default, gathered(KeywordArg("a")), *scaled_tail),
         "all_gather_matmul", emit_all_gather_scaled_matmul, scaled_ok(True)),
        (CallFunction(aten._scaled_mm.default, gathered_fp8, *scaled_tail),
         "all_gather_matmul", emit_all_gather_scaled_matmul, scaled_ok(True)),
        (scattered(CallFunction(aten.mm.default, KeywordArg("a"), KeywordArg("b"))),
         "matmul_reduce_scatter", emit_matmul_reduce_scatter, always),
        (scattered(CallFunction(aten._scaled_mm.default, KeywordArg("a"), *scaled_tail)),
         "matmul_reduce_scatter", emit_scaled_matmul_reduce_scatter, scaled_ok(False)),
    ):
        register_graph_pattern(
            pattern, extra_check=lambda m, name=name, fits=fits: fits(m) and gate(name, _mm_in_match(m)),
            pass_dict=patterns,
        )(functools.partial(_replace_with_fused, emit=emit))

    return patterns


def _replace_with_fused(match: Match, *, emit, **operands: object) -> None:
    """Put ``emit(builder, **operands)`` where the matched sub-graph's output was and erase the match (and a
    row-wise scale's gather that only the matmul read)."""
    out = match.output_node()
    scale = operands.get("scale_a")
    with out.graph.inserting_before(out):
        result = emit(GraphBuilder(out.graph), **operands)
    out.replace_all_uses_with(result)
    match.erase_nodes()
    if isinstance(scale, fx.Node) and scale.target is c10d.wait_tensor.default:
        _erase_if_unused(scale, scale.args[0])


def apply_async_tp(
    graph: fx.Graph,
    *,
    tp_size: int,
    group_name: str,
    use_symm_mem: bool,
    m_low: int,
    rule: MatmulRule | None,
    default: str,
) -> AsyncTPDecisions:
    """Fuse the all_gather->mm and mm->reduce_scatter pairs of ``graph`` in place; return the gate's log."""
    decisions = AsyncTPDecisions()
    gate = _Gate(tp_size, m_low, rule, default, decisions)
    # Patterns bake tp_size and the group name in; the gate (with its log) changes per compile.
    patterns = _build_patterns(tp_size, group_name, use_symm_mem, gate)
    original = _normalise_matmuls(graph)
    patterns.apply(graph)
    for node, (args, kwargs) in original.items():
        if node.graph is graph and not node._erased:
            node.args, node.kwargs = args, kwargs
    graph.eliminate_dead_code()
    return decisions

