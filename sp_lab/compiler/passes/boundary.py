"""What happens where a sequence-parallel (token-sharded) value leaves a piece.

Inside one piece SP turns ``all_reduce -> add -> norm`` into ``reduce_scatter -> add -> norm -> all_gather``,
so the residual that flows on to the next piece is a token shard ``[ceil(N/tp), H]`` instead of ``[N, H]``.
It leaves a piece in one of two ways (docs/piecewise-boundaries.md):

- as a piece *output*: the next piece was compiled for ``[N, H]`` and Inductor's input guard
  ``assert_size_stride`` fails;
- through the *epilogue* ``copy_(input, mutated)`` that functionalization emits when the piece updates its
  residual input in place (vLLM's fused add+norm): the copy fails with a shape mismatch at compile time.

A :class:`BoundaryPolicy` applies a :class:`~sp_lab.config.BoundaryStrategy` (whose attributes say what to do) in
those two places. ``sharded`` rewrites the whole graph before splitting, so boundaries carry the shard and every
piece is compiled for the shapes it really receives (``RangeCompiler._compile_sharded`` in
``compiler/range_compiler.py``); at the whole graph's own edges (the model's outputs and in-place inputs) it
gathers, as a full-graph compile does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import fx

from sp_lab.compiler.inspection import shape_json
from sp_lab.compiler.report import CopyEvent
from sp_lab.config import BoundaryStrategy

__all__ = ["BoundaryEvents", "BoundaryPolicy"]


@dataclass
class BoundaryEvents:
    """What a policy did to one graph (its copy events go into the piece's CompileReport record)."""

    gathered_outputs: list[str] = field(default_factory=list)
    copies: list[CopyEvent] = field(default_factory=list)

    def copies_by(self, action: str) -> list[CopyEvent]:
        return [c for c in self.copies if c.action == action]


@dataclass(frozen=True)
class BoundaryPolicy:
    """Hands sharded values across a graph's edges as ``strategy`` says (its ``gathers_outputs`` and ``copies``)."""

    strategy: BoundaryStrategy

    def output(self, node: fx.Node, shard: fx.Node, full: Callable[[], fx.Node], events: BoundaryEvents) -> fx.Node:
        """The value to return in place of ``node``, whose token-sharded form is ``shard``."""
        if self.strategy.gathers_outputs:
            events.gathered_outputs.append(node.name)
            return full()
        return shard

    def copy(
        self, copy_node: fx.Node, shard: fx.Node, full: Callable[[], fx.Node], events: BoundaryEvents
    ) -> None:
        """Rewrite the epilogue ``copy_(dst, src)`` whose ``src`` is now held as ``shard``."""
        dst = copy_node.args[0]
        action = {"gather": "gathered", "erase": "erased", "keep": "kept"}[self.strategy.copies]
        events.copies.append(CopyEvent(dst.name, shape_json(dst.meta["val"]), shape_json(shard.meta["val"]), action))
        if self.strategy.copies == "gather":
            copy_node.replace_input_with(copy_node.args[1], full())
        elif self.strategy.copies == "erase":
            # The draft's fix, kept to demonstrate it: the in-place residual update is lost.
            copy_node.replace_all_uses_with(dst)
            copy_node.graph.erase_node(copy_node)
        else:
            copy_node.replace_input_with(copy_node.args[1], shard)
