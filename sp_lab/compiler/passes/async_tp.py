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

import logging
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, fwd_only, register_replacement
from torch._subclasses.fake_tensor import unset_fake_temporarily

import sp_lab.compiler.fused_ops  # noqa: F401  (registers torch.ops.sp_lab.fused_*)
from sp_lab.rules import MatmulRule

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
log = logging.getLogger(__name__)

__all__ = ["AsyncTPDecisions", "apply_async_tp"]


@dataclass
class AsyncTPDecisions:
    """Every fusion candidate the gate saw: {"pattern", "m", "n", "k", "decision", "why"}."""

    candidates: list[dict] = field(default_factory=list)

    def fused(self, pattern: str) -> int:
        return sum(c["pattern"] == pattern and c["decision"] == "fuse" for c in self.candidates)


@dataclass(frozen=True)
class _Gate:
    """The per-matmul decision, shared by both patterns (a fresh one per compile, holding the log)."""

    tp_size: int
    m_low: int
    rule: MatmulRule | None
    default: str
    decisions: AsyncTPDecisions

    def __call__(self, pattern: str, mm_node: fx.Node | None, rows_factor: int) -> bool:
        val_a = mm_node.args[0].meta.get("val") if mm_node is not None else None
        val_b = mm_node.args[1].meta.get("val") if mm_node is not None else None
        if not isinstance(val_a, torch.Tensor) or not isinstance(val_b, torch.Tensor):
            log.warning(
                "AsyncTP gate: cannot read the shapes of matmul %s (no meta['val']); applying heuristic_default=%r",
                getattr(mm_node, "name", "<unknown>"),
                self.default,
            )
            self.decisions.candidates.append(
                {"pattern": pattern, "m": None, "n": None, "k": None, "decision": self.default,
                 "why": "shapes unreadable: heuristic_default"}
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
        self.decisions.candidates.append({"pattern": pattern, "m": m, "n": n, "k": k, "decision": decision, "why": why})
        return decision == "fuse"


def _mm_in_match(match: Match) -> fx.Node | None:
    return next((n for n in match.nodes if n.target is aten.mm.default), None)


def _build_patterns(tp_size: int, group_name: str, use_symm_mem: bool, gate: _Gate) -> PatternMatcherPass:
    patterns = PatternMatcherPass(pass_name="sp_lab_async_tp")

    def ag_mm_search(a, b):
        gathered = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(a, tp_size, group_name))
        return aten.mm.default(gathered, b)

    def mm_rs_search(a, b):
        return c10d.wait_tensor.default(
            c10d.reduce_scatter_tensor.default(aten.mm.default(a, b), "sum", tp_size, group_name)
        )

    if use_symm_mem:
        def ag_mm_replace(a, b):
            _, outs = torch.ops.symm_mem.fused_all_gather_matmul.default(a, [b], 0, group_name)
            return outs[0]

        def mm_rs_replace(a, b):
            return torch.ops.symm_mem.fused_matmul_reduce_scatter.default(a, b, "sum", 0, group_name)
    else:
        def ag_mm_replace(a, b):
            return torch.ops.sp_lab.fused_all_gather_matmul.default(a, b, group_name, tp_size)

        def mm_rs_replace(a, b):
            return torch.ops.sp_lab.fused_matmul_reduce_scatter.default(a, b, group_name, tp_size)

    # Meta tensors: tracing the patterns must not run a real collective on a live process group.
    example = [torch.empty(4, 8, device="meta"), torch.empty(8, 16, device="meta")]
    rs_example = [torch.empty(4 * tp_size, 8, device="meta"), torch.empty(8, 16, device="meta")]
    register_replacement(
        ag_mm_search, ag_mm_replace, example, fwd_only, patterns,
        extra_check=lambda match: gate("all_gather_matmul", _mm_in_match(match), tp_size),
    )
    register_replacement(
        mm_rs_search, mm_rs_replace, rs_example, fwd_only, patterns,
        extra_check=lambda match: gate("matmul_reduce_scatter", _mm_in_match(match), 1),
    )
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
    # The pattern functions are traced with real example tensors, outside the fake mode Inductor runs us in.
    with unset_fake_temporarily():
        patterns = _build_patterns(tp_size, group_name, use_symm_mem, gate)
    patterns.apply(graph)
    graph.eliminate_dead_code()
    return decisions

