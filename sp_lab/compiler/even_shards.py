"""Token counts a DTensor model can run at: shards made with ``DTensor.from_local`` and no global shape.

``DTensor.from_local(local, mesh, [Shard(d)])`` without ``shape=`` takes the global size of dim ``d`` to be
``mesh size x local size``, i.e. it assumes every rank holds an equal shard. torchtitan's ``SequenceParallel``
does this for the token dimension; the shards come from DTensor's own chunking of the ``N`` tokens (``ceil(N /
tp)`` on the first ranks, the rest on the last), which are equal only when tp divides ``N``. At any other count
the ranks disagree on the global size and then on the size of the next collective: eagerly, gloo aborts the
process ("Received data size doesn't match expected size"). sp_lab reads the requirement from the captured
graph and rejects such counts up front, on every rank alike, with a message saying how to pad.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy
import torch
from torch import fx

__all__ = ["EvenShards", "even_shards"]


@dataclass(frozen=True)
class EvenShards:
    """The token count must be a multiple of ``multiple`` (1: no requirement); ``where`` says which call asks."""

    multiple: int = 1
    where: str = ""

    def check(self, num_tokens: int) -> None:
        """Raise ValueError if ``num_tokens`` breaks the requirement."""
        if num_tokens % self.multiple == 0:
            return
        up = -(-num_tokens // self.multiple) * self.multiple
        raise ValueError(
            f"{num_tokens} tokens: this model runs only at token counts that are a multiple of {self.multiple}. "
            f"It makes token-sharded DTensors with {self.where} and no shape= (torchtitan's SequenceParallel "
            f"does), which DTensor sizes as if every rank held an equal shard of the tokens; at {num_tokens} "
            f"the shards are uneven and the ranks would disagree on the size of a collective (eagerly, gloo "
            f"aborts). Pad the tokens to a multiple of {self.multiple} (here {up}), or give DTensor.from_local "
            "the global shape."
        )

    def merged(self, other: EvenShards) -> EvenShards:
        if other.multiple == 1:
            return self
        if self.multiple == 1:
            return other
        return EvenShards(math.lcm(self.multiple, other.multiple), self.where)


def even_shards(gm: fx.GraphModule, tokens: torch.SymInt | int, tp_size: int) -> EvenShards:
    """The requirement the Dynamo graph ``gm`` puts on the token count, whose size in ``gm`` is ``tokens``.

    A ``from_local`` call asks for one when it has no ``shape`` and shards a dimension whose local size is a
    chunk of the token count (a size that is not a polynomial in ``N``, e.g. ``(N + 1) // 2``).
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tokens, torch.SymInt) or not tokens.node.expr.is_Symbol:
        return EvenShards()  # a static count (a graph traced for one count) has no symbol to find in the shard sizes
    symbol = tokens.node.expr
    found = EvenShards()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not DTensor.from_local or node.kwargs.get("shape"):
            continue
        local = node.args[0].meta.get("example_value") if isinstance(node.args[0], fx.Node) else None
        placements = node.args[2] if len(node.args) > 2 else node.kwargs.get("placements")
        if not isinstance(local, torch.Tensor) or not placements:
            continue
        for mesh_dim, placement in enumerate(placements):
            if not isinstance(placement, Shard):
                continue
            size = local.shape[placement.dim]
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if expr is None or symbol not in expr.free_symbols or expr.is_polynomial(symbol):
                continue
            in_n = {symbol: sympy.Symbol("N")}
            shape = ", ".join(str(d.node.expr.xreplace(in_n)) if isinstance(d, torch.SymInt) else str(d) for d in local.shape)
            where = f"DTensor.from_local(..., [{placement}]) on a [{shape}] shard of N tokens"
            found = found.merged(EvenShards(_mesh_size(node, mesh_dim, tp_size), where))
    return found


def _mesh_size(node: fx.Node, mesh_dim: int, tp_size: int) -> int:
    """Size of ``mesh_dim`` of the call's device mesh; ``tp_size`` where Dynamo's graph hides the mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("device_mesh")
    value = arg.meta.get("example_value") if isinstance(arg, fx.Node) else arg
    value = getattr(value, "real_obj", value)
    return value.size(mesh_dim) if isinstance(value, DeviceMesh) else tp_size
