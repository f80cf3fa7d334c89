"""Reading FX graphs into report records: op counts, snapshots, fingerprints, where a node came from.

The records themselves (and their JSON) are in ``sp_lab.compiler.report``, which imports no torch; this is
the torch side that fills them. Its source is part of the passes' cache key (``passes/post_grad.py``): a
change in how ops are counted must not be served counts recorded by the old code.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import is_fake

from sp_lab.compiler.report import (
    OP_KEYS,
    CountKey,
    GraphSnapshot,
    NodeRecord,
    Shape,
    TensorSpec,
)

__all__ = [
    "COUNTED_OPS",
    "graph_snapshot",
    "node_kind",
    "node_module",
    "node_source",
    "op_counts",
    "qualified_name",
    "shape_json",
    "structural_fingerprint",
    "tensor_spec",
]

# Report key -> qualified op names counted under it (sp_lab's CPU ops and PyTorch's CUDA kernels alike).
COUNTED_OPS: dict[CountKey, tuple[str, ...]] = {
    CountKey.ALL_REDUCE: ("_c10d_functional::all_reduce",),
    CountKey.REDUCE_SCATTER: ("_c10d_functional::reduce_scatter_tensor",),
    CountKey.ALL_GATHER: ("_c10d_functional::all_gather_into_tensor",),
    # Scaled (FP8) matmuls count with the others: a fused op is a fused op, a matmul a matmul.
    CountKey.FUSED_ALL_GATHER_MATMUL: (
        "sp_lab::fused_all_gather_matmul",
        "symm_mem::fused_all_gather_matmul",
        "sp_lab::fused_all_gather_scaled_matmul",
        "symm_mem::fused_all_gather_scaled_matmul",
    ),
    CountKey.FUSED_MATMUL_REDUCE_SCATTER: (
        "sp_lab::fused_matmul_reduce_scatter",
        "symm_mem::fused_matmul_reduce_scatter",
        "sp_lab::fused_scaled_matmul_reduce_scatter",
        "symm_mem::fused_scaled_matmul_reduce_scatter",
    ),
    CountKey.MM: ("aten::mm", "aten::addmm", "aten::_scaled_mm"),
}
assert tuple(COUNTED_OPS) == OP_KEYS
_KEY_OF = {name: key for key, names in COUNTED_OPS.items() for name in names}
_NORM_OPS = {"aten::rsqrt", "aten::mean", "aten::var_mean", "aten::native_layer_norm", "aten::rms_norm"}
_TORCH_DIR = torch.__file__.rsplit("/", 1)[0] + "/"
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\s*$')


def qualified_name(target: Any) -> str | None:
    """``"ns::name"`` of an op overload or packet, else None."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def op_counts(graph: fx.Graph) -> dict[CountKey, int]:
    """Counts of the collectives, fused ops and matmuls in ``graph`` (keys of :data:`COUNTED_OPS`)."""
    counts = dict.fromkeys(COUNTED_OPS, 0)
    for node in graph.nodes:
        key = _KEY_OF.get(qualified_name(node.target)) if node.op == "call_function" else None
        if key:
            counts[key] += 1
    return counts


def node_kind(node: fx.Node, splitting_ops: frozenset[str] = frozenset()) -> str:
    """The explorer's colour class of a node."""
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    name = qualified_name(node.target) or ""
    key = _KEY_OF.get(name)
    if key in (CountKey.FUSED_ALL_GATHER_MATMUL, CountKey.FUSED_MATMUL_REDUCE_SCATTER):
        return "fused"
    if key == CountKey.MM:
        return "matmul"
    if name.startswith("_c10d_functional::"):
        return "collective"
    if name in splitting_ops:
        return "split"
    if name in _NORM_OPS:
        return "norm"
    return "other"


def shape_json(value: Any) -> Shape | None:
    """A tensor's shape as ints and symbolic expressions (strings), or None for non-tensors."""
    if not isinstance(value, torch.Tensor):
        return None
    return tuple(int(s) if isinstance(s, int) else str(s) for s in value.shape)


def tensor_spec(name: str, value: Any) -> TensorSpec:
    """Name, shape and dtype of a graph value (shape and dtype None for non-tensors)."""
    if not isinstance(value, torch.Tensor):
        return TensorSpec(name)
    return TensorSpec(name, shape_json(value), str(value.dtype).removeprefix("torch."))


def node_module(node: fx.Node) -> str | None:
    """The module path that made ``node`` (``"model.layers.3.mlp"``), from Dynamo's ``nn_module_stack``."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    # Dynamo writes sources: "L['self'].model.layers.0" or "L['self'].model.layers[0]".
    path = re.sub(r"^L\['self'\]\.?", "", str(path))
    return re.sub(r"\[(\d+)\]", r".\1", path).replace("_modules.", "") or None


def node_source(node: fx.Node) -> str | None:
    """The model's line that made ``node``: the innermost frame of its stack trace outside torch, written
    ``"layers.py:57  return F.linear(x, w)"``."""
    return innermost_user_frame(node.meta.get("stack_trace"))


def innermost_user_frame(stack_trace: str | None) -> str | None:
    """The last frame outside torch of a traceback text (as FX keeps in ``meta["stack_trace"]``)."""
    if not stack_trace:
        return None
    found = None
    lines = stack_trace.splitlines()
    for i, text in enumerate(lines):
        m = _FRAME.match(text)
        if m and not m["file"].startswith(_TORCH_DIR):
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            found = f"{m['file'].rsplit('/', 1)[-1]}:{m['line']}  {code}".rstrip()
    return found


def target_str(node: fx.Node) -> str:
    """``"aten.mm.default"`` for ops, the function or method name otherwise."""
    name = qualified_name(node.target)
    if name is not None:
        overload = getattr(node.target, "_overloadname", "")
        return f"{name.replace('::', '.')}.{overload}" if overload else name.replace("::", ".")
    return getattr(node.target, "__name__", str(node.target))


def graph_snapshot(graph: fx.Graph, splitting_ops: frozenset[str] = frozenset()) -> GraphSnapshot:
    """Nodes (name, op, target, kind, shape, dtype, module, source line) and edges of ``graph``."""
    nodes, edges = [], []
    for node in graph.nodes:
        val = node.meta.get("val")
        nodes.append(
            NodeRecord(
                name=node.name,
                op=node.op,
                target=target_str(node),
                kind=node_kind(node, splitting_ops),
                shape=shape_json(val),
                dtype=str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else None,
                module=node_module(node),
                source=node_source(node),
            )
        )
        edges.extend((src.name, node.name) for src in node.all_input_nodes)
    return GraphSnapshot(tuple(nodes), tuple(edges))


def structural_fingerprint(gm: fx.GraphModule, example_inputs: list[Any]) -> str:
    """A hash of a piece's structure and input shapes, blind to node names and to the weights it is given.

    Two decoder layers' pieces differ only in which weights they read -- and weights are graph inputs -- so
    they share a fingerprint and one compiled artifact serves both. Everything that decides what a node
    computes is in it: the function or method it calls, and what a module call or an attribute read stands for
    (:func:`_node_target`).
    """
    index = {node: i for i, node in enumerate(gm.graph.nodes)}

    def arg_repr(arg: Any) -> Any:
        return fx.node.map_aggregate(arg, lambda a: f"%{index[a]}" if isinstance(a, fx.Node) else repr(a))

    parts = [(node.op, _node_target(gm, node), arg_repr(node.args), arg_repr(node.kwargs)) for node in gm.graph.nodes]
    parts.append([(shape_json(x), str(getattr(x, "dtype", type(x).__name__))) for x in example_inputs])
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def _node_target(gm: fx.GraphModule, node: fx.Node) -> Any:
    """What ``node`` runs, for the fingerprint: an op's overload, a function by its module and qualified name
    (``operator.add`` is not ``torch.add``), a method by its name. A submodule or attribute is named by its path,
    which no two different objects share within a model; an attribute's tensor also by its shape, dtype and
    values (a constant the graph holds, not a weight), where they are materialised."""
    if node.op in ("placeholder", "output"):
        return node.op
    if node.op == "call_function":
        if qualified_name(node.target) is not None:
            return target_str(node)
        fn = node.target
        return f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', repr(fn))}"
    if node.op == "get_attr":
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor):
            return node.target, _tensor_digest(value)
    return node.target  # call_method: the method's name; call_module: the submodule's path


def _tensor_digest(x: torch.Tensor) -> str:
    """Shape, dtype and a hash of the values of a (small, constant) tensor; shape and dtype alone where it has
    no data (meta or fake tensors)."""
    head = f"{tuple(x.shape)}:{x.dtype}"
    if x.is_meta or is_fake(x):
        return head
    data = x.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return f"{head}:{hashlib.sha1(data.numpy().tobytes()).hexdigest()[:16]}"
