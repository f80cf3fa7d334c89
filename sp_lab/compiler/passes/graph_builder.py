"""Insert aten nodes into an FX graph with their fake values, and the token-dimension vocabulary SP needs.

Every node a pass adds carries ``meta["val"]`` (a FakeTensor or SymInt) computed by running the op on the
fake values of its inputs, so later passes, the pattern matcher and Inductor's lowering see real shapes.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# Float8 types collectives move as uint8 (same size, any backend).
FP8_BYTES_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

__all__ = ["FP8_BYTES_DTYPES", "GraphBuilder", "fake_value", "is_tensor_node", "same_size"]

# Where a node came from: copied onto the nodes a pass adds in its place, so the report can still name the
# model's tensor (``residual``), its module and source line after SP rewrote it.
_PROVENANCE_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node")


def fake_value(arg: Any) -> Any:
    """The fake value behind an FX argument (nodes are replaced by their ``meta["val"]``)."""
    return fx.node.map_arg(arg, lambda n: n.meta["val"]) if isinstance(arg, (fx.Node, list, tuple)) else arg


def is_tensor_node(arg: Any) -> bool:
    return isinstance(arg, fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor)


def same_size(a: Any, b: Any) -> bool:
    """``a == b`` for ints or SymInts without installing a guard (a guard here would force recompiles)."""
    return bool(statically_known_true(a == b))


class GraphBuilder:
    """Adds nodes to ``graph`` at its current insertion point, with fake values."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        placeholders = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
        self.fake_mode = detect_fake_mode(placeholders)
        self._standing_for: fx.Node | None = None

    @contextlib.contextmanager
    def standing_for(self, node: fx.Node) -> Iterator[None]:
        """Nodes added inside this block replace ``node``: they take its stack trace and module stack."""
        previous, self._standing_for = self._standing_for, node
        try:
            yield
        finally:
            self._standing_for = previous

    def call(self, target: Callable, *args: Any, **kwargs: Any) -> fx.Node:
        """Insert ``target(*args, **kwargs)`` and compute its fake value."""
        node = self.graph.call_function(target, tuple(args), kwargs)
        if self._standing_for is not None:
            node.meta.update({k: self._standing_for.meta[k] for k in _PROVENANCE_META if k in self._standing_for.meta})
        inputs = node.all_input_nodes
        if any("val" not in n.meta for n in inputs):
            return node  # an input without a fake value: nothing to infer from (a warning was logged upstream)
        fake_args, fake_kwargs = fake_value(tuple(args)), {k: fake_value(v) for k, v in kwargs.items()}
        if self.fake_mode is not None and isinstance(target, torch._ops.OpOverload):
            with self.fake_mode:
                node.meta["val"] = target(*fake_args, **fake_kwargs)
        else:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node

    def sym(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Integer arithmetic on sizes: folded when every operand is a Python int, else an FX node."""
        if all(isinstance(a, int) for a in args):
            return fn(*args)
        return self.call(fn, *args)

    def size(self, tensor: fx.Node, dim: int) -> Any:
        """The size of ``tensor`` along ``dim``: an int, or a ``sym_size`` node when it is symbolic."""
        value = tensor.meta["val"].shape[dim]
        return value if isinstance(value, int) else self.call(aten.sym_size.int, tensor, dim)

    # -- token-dimension layout ------------------------------------------------------------------------------
    def pad_rows(self, tensor: fx.Node, rows: Any, dim: int = 0) -> fx.Node:
        """Append ``rows`` zero rows to ``dim`` (``rows`` may be 0 at run time)."""
        ndim = tensor.meta["val"].dim()
        return self.call(aten.constant_pad_nd.default, tensor, [0, 0] * (ndim - 1 - dim) + [0, rows], 0.0)

    def narrow_rows(self, tensor: fx.Node, start: Any, length: Any, dim: int = 0) -> fx.Node:
        end = length if isinstance(start, int) and start == 0 else self.sym(operator.add, start, length)
        return self.call(aten.slice.Tensor, tensor, dim, start, end)

    def view(self, tensor: fx.Node, shape: list[Any]) -> fx.Node:
        return self.call(aten.reshape.default, tensor, shape)

    def all_gather(self, shard: fx.Node, group_size: int, group_name: str) -> fx.Node:
        """All-gather along dim 0. FP8 values travel as their bytes (``view(uint8)``): gloo has no float8
        type ("Invalid scalar type"), and for NCCL the bytes are the same."""
        dtype = shard.meta["val"].dtype if is_tensor_node(shard) else None
        if dtype in FP8_BYTES_DTYPES:
            shard = self.call(aten.view.dtype, shard, torch.uint8)
        gathered = self.call(c10d.wait_tensor.default,
                             self.call(c10d.all_gather_into_tensor.default, shard, group_size, group_name))
        return self.call(aten.view.dtype, gathered, dtype) if dtype in FP8_BYTES_DTYPES else gathered

    def reduce_scatter(self, tensor: fx.Node, group_size: int, group_name: str) -> fx.Node:
        scattered = self.call(c10d.reduce_scatter_tensor.default, tensor, "sum", group_size, group_name)
        return self.call(c10d.wait_tensor.default, scattered)
