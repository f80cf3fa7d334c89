"""What happens where a sequence-parallel (token-sharded) value leaves a piece.

Inside one piece SP turns ``all_reduce -> add -> norm`` into ``reduce_scatter -> add -> norm -> all_gather``,
so the residual that flows on to the next piece is a token shard ``[ceil(N/tp), H]`` instead of ``[N, H]``.
It leaves a piece in one of two ways (docs/piecewise-boundaries.md):

- as a piece *output*: the next piece was compiled for ``[N, H]`` and Inductor's input guard
  ``assert_size_stride`` fails;
- through the *epilogue* ``copy_(input, mutated)`` that functionalization emits when the piece updates its
  residual input in place (vLLM's fused add+norm): the copy fails with a shape mismatch at compile time.

A :class:`BoundaryPolicy` decides what the SP rewrite puts in those two places. ``sharded`` needs no policy
here: it rewrites the whole graph before splitting, so boundaries carry the shard and every piece is
compiled for the shapes it really receives (see ``compiler/split.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import fx

from sp_lab.compiler.inspection import shape_json
from sp_lab.compiler.report import CopyEvent

__all__ = ["BoundaryEvents", "BoundaryPolicy", "policy_for"]


@dataclass
class BoundaryEvents:
    """What a policy did to one graph (its copy events go into the piece's CompileReport record)."""

    gathered_outputs: list[str] = field(default_factory=list)
    sharded_outputs: list[str] = field(default_factory=list)
    copies: list[CopyEvent] = field(default_factory=list)

    def copies_by(self, action: str) -> list[CopyEvent]:
        return [c for c in self.copies if c.action == action]


@dataclass(frozen=True)
class BoundaryPolicy:
    """How sharded values are handed across a piece boundary.

    Attributes:
        name: the strategy ("none", "gather_erase", "gather", or "whole_graph" for SP applied before splitting).
        gather_outputs: all-gather every output whose token dimension was sharded.
        copies: what to do with an epilogue ``copy_(dst [N, H], src)`` whose source became a shard:
            "keep" (leave the mismatched copy: the known failure), "erase" (the draft's fix: drop it, which
            silently loses in-place residual updates), "gather" (all-gather into the copy: correct).
    """

    name: str
    gather_outputs: bool
    copies: str

    def output(self, node: fx.Node, shard: fx.Node, full: Callable[[], fx.Node], events: BoundaryEvents) -> fx.Node:
        """The value to return in place of ``node``, whose token-sharded form is ``shard``."""
        if self.gather_outputs:
            events.gathered_outputs.append(node.name)
            return full()
        events.sharded_outputs.append(node.name)
        return shard

    def copy(
        self, copy_node: fx.Node, shard: fx.Node, full: Callable[[], fx.Node], events: BoundaryEvents
    ) -> None:
        """Rewrite the epilogue ``copy_(dst, src)`` whose ``src`` is now held as ``shard``."""
        dst = copy_node.args[0]
        action = {"gather": "gathered", "erase": "erased", "keep": "kept"}[self.copies]
        events.copies.append(CopyEvent(dst.name, shape_json(dst.meta["val"]), shape_json(shard.meta["val"]), action))
        if self.copies == "gather":
            copy_node.replace_input_with(copy_node.args[1], full())
        elif self.copies == "erase":
            # The draft's fix, kept to demonstrate it: the in-place residual update is lost.
            copy_node.replace_all_uses_with(dst)
            copy_node.graph.erase_node(copy_node)
        else:
            copy_node.replace_input_with(copy_node.args[1], shard)


_POLICIES = {
    "none": BoundaryPolicy("none", gather_outputs=False, copies="keep"),
    "gather_erase": BoundaryPolicy("gather_erase", gather_outputs=True, copies="erase"),
    "gather": BoundaryPolicy("gather", gather_outputs=True, copies="gather"),
    "whole_graph": BoundaryPolicy("whole_graph", gather_outputs=True, copies="gather"),
}


def policy_for(name: str) -> BoundaryPolicy:
    """The policy for a boundary strategy name ("sharded" and full-graph compiles use "whole_graph")."""
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown boundary policy {name!r}; expected one of {sorted(_POLICIES)}") from None
