"""Split a captured graph at its splitting ops (attention) into pieces.

Each splitting op gets a partition of its own; everything between two of them is one piece that Inductor
compiles. ``keep_original_order=True`` matters: without it ``split_module`` may reorder nodes across
partitions, and an in-place update (the residual ``add_``) could move past a read of the same tensor.
"""

from __future__ import annotations

import functools
import logging
import operator
from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from sp_lab.compiler.inspection import qualified_name

__all__ = ["Piece", "SplitGraph", "node_op_name", "split_at"]

log = logging.getLogger(__name__)


# An op that mutates an argument (vLLM's ``unified_attention_with_output(q, k, v, output, layer_name)``) reaches
# an AOT (functional aten) graph wrapped in one of these higher-order ops, the op itself as first argument.
_FUNCTIONALIZED = tuple(
    op for op in (getattr(torch.ops.higher_order, name, None) for name in ("auto_functionalized",
                                                                           "auto_functionalized_v2"))
    if op is not None
)


def node_op_name(node: fx.Node) -> str | None:
    """The qualified op a ``call_function`` node runs, looking through auto-functionalization."""
    if node.op != "call_function":
        return None
    if node.target in _FUNCTIONALIZED and node.args:
        return qualified_name(node.args[0])
    return qualified_name(node.target)


@dataclass
class Piece:
    """One submodule of the split graph, in execution order."""

    index: int
    name: str  # attribute name on the split module ("submod_3")
    splitting_op: str | None  # "sp_lab::attention" for split-op partitions, None for compiled pieces


@dataclass
class SplitGraph:
    module: fx.GraphModule
    pieces: list[Piece]

    @property
    def compiled_pieces(self) -> list[Piece]:
        return [p for p in self.pieces if p.splitting_op is None]


def split_at(gm: fx.GraphModule, splitting_ops: list[str]) -> SplitGraph:
    """Split ``gm`` so every call of an op in ``splitting_ops`` ("ns::name") is a partition of its own."""
    wanted = set(splitting_ops)
    partition_of: dict[fx.Node, int] = {}
    split_kind: dict[int, str] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        name = node_op_name(node)
        if node.target is operator.getitem and partition_of.get(node.args[0]) in split_kind:
            # An op with several outputs: its getitems stay with it, so the next piece receives tensors, not the
            # tuple (Inductor takes tensor inputs only).
            partition_of[node] = partition_of[node.args[0]]
        elif name in wanted:
            current += 1
            partition_of[node] = current
            split_kind[current] = name
            current += 1
        else:
            partition_of[node] = current
    if wanted and not split_kind:
        _maybe_explain_sdpa(gm, splitting_ops)
    split_gm = split_module(gm, None, lambda n: partition_of[n], keep_original_order=True)
    pieces = []
    for node in split_gm.graph.nodes:
        if node.op == "call_module":
            pid = int(node.target.rsplit("_", 1)[1])
            pieces.append(Piece(len(pieces), node.target, split_kind.get(pid)))
    return SplitGraph(split_gm, pieces)


def _maybe_explain_sdpa(gm: fx.GraphModule, splitting_ops: list[str]) -> None:
    """Say why a graph that runs SDPA did not split: the usual cause is a Hugging Face model's own attention."""
    sdpa = next((n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in (
        node_op_name(n) or getattr(n.target, "__name__", ""))), None)
    if sdpa is not None:
        _warn_once(
            f"splitting_ops={splitting_ops} matched no op, but the graph calls scaled_dot_product_attention "
            f"({sdpa.name}), which cannot be a splitting op (Dynamo records it as a Python builtin, and the sharded "
            "boundary's aten graph holds a device-specific kernel instead): the model compiles as one piece. For a "
            "transformers model load it with attn_implementation=sp_lab.models.register_hf_attention(); in your own "
            "model call attention through a custom op and name that op in LabConfig.splitting_ops"
        )


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)  # once per process: every token range splits the same graph
