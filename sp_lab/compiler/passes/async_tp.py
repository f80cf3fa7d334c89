"""AsyncTP: fuse ``all_gather -> mm`` and ``mm -> reduce_scatter`` into single collective-matmul ops.

Written with Inductor's pattern matcher: both rewrites are fixed sub-graphs of the post-grad graph that the
SP rewrite leaves behind. The gate is the pattern's ``extra_check``, which reads the matmul's real shapes
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
    KeywordArg,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)

import sp_lab.compiler.fused_ops  # noqa: F401  (registers torch.ops.sp_lab.fused_*)
from sp_lab.compiler.passes.graph_builder import GraphBuilder
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
        val_a = mm_node.args[0].meta.get("val") if mm_node is not None else None
        val_b = mm_node.args[1].meta.get("val") if mm_node is not None else None
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
            answer = self.rule.decide(m, n, k, self.tp_size)
            decision = self.default if answer == "unsure" else answer
            why = f"heuristic answered {answer!r}" + (f" -> heuristic_default {self.default!r}" if answer == "unsure" else "")
        self.decisions.candidates.append(FusionDecision(pattern, m, n, k, decision, why))
        return decision == "fuse"


def _mm_in_match(match: Match) -> fx.Node | None:
    return next((n for n in match.nodes if n.target is aten.mm.default), None)


def _replace_with_fused(match: Match, a: fx.Node, b: fx.Node, *, emit) -> None:
    """Put ``emit(builder, a, b)`` where the matched sub-graph's output was and erase the match."""
    out = match.output_node()
    with out.graph.inserting_before(out):
        result = emit(GraphBuilder(out.graph), a, b)
    out.replace_all_uses_with(result)
    match.erase_nodes()


def _build_patterns(tp_size: int, group_name: str, use_symm_mem: bool, gate: _Gate) -> PatternMatcherPass:
    """The two fusions as graph patterns with hand-written replacements.

    ``register_graph_pattern`` rather than ``register_replacement``: the latter re-traces the replacement with
    the matched operands' fake values before ``extra_check`` runs, so a matmul whose shapes are unknown would
    crash the compile instead of reaching the gate's "unreadable -> heuristic_default" branch.
    """
    patterns = PatternMatcherPass(pass_name="sp_lab_async_tp")
    gathered = CallFunction(
        c10d.wait_tensor.default, CallFunction(c10d.all_gather_into_tensor.default, KeywordArg("a"), tp_size, group_name)
    )
    ag_mm = CallFunction(aten.mm.default, gathered, KeywordArg("b"))
    mm_rs = CallFunction(
        c10d.wait_tensor.default,
        CallFunction(
            c10d.reduce_scatter_tensor.default,
            CallFunction(aten.mm.default, KeywordArg("a"), KeywordArg("b")),
            "sum",
            tp_size,
            group_name,
        ),
    )

    def emit_all_gather_matmul(build: GraphBuilder, a: fx.Node, b: fx.Node) -> fx.Node:
        if use_symm_mem:
            fused = build.call(torch.ops.symm_mem.fused_all_gather_matmul.default, a, [b], 0, group_name)
            return build.call(operator.getitem, build.call(operator.getitem, fused, 1), 0)
        return build.call(torch.ops.sp_lab.fused_all_gather_matmul.default, a, b, group_name, tp_size)

    def emit_matmul_reduce_scatter(build: GraphBuilder, a: fx.Node, b: fx.Node) -> fx.Node:
        if use_symm_mem:
            return build.call(torch.ops.symm_mem.fused_matmul_reduce_scatter.default, a, b, "sum", 0, group_name)
        return build.call(torch.ops.sp_lab.fused_matmul_reduce_scatter.default, a, b, group_name, tp_size)

    for pattern, name, emit in (
        (ag_mm, "all_gather_matmul", emit_all_gather_matmul),
        (mm_rs, "matmul_reduce_scatter", emit_matmul_reduce_scatter),
    ):
        register_graph_pattern(
            pattern, extra_check=lambda m, name=name: gate(name, _mm_in_match(m)), pass_dict=patterns
        )(functools.partial(_replace_with_fused, emit=emit))

    return patterns


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
    patterns.apply(graph)
    graph.eliminate_dead_code()
    return decisions

