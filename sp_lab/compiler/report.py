"""CompileReport: what the compiler did, per token range and per piece, as plain JSON-able data.

It is the data behind the graph explorer (``sp_lab.viz.graph``) and the provenance of every sweep row: how
many SP rewrites and fused ops really ran for the range that served a token count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

__all__ = [
    "COUNTED_OPS",
    "BoundaryFailure",
    "CompileReport",
    "PieceRecord",
    "RangeReport",
    "ReportError",
    "graph_snapshot",
    "op_counts",
    "shape_json",
    "structural_fingerprint",
]

SCHEMA = "sp_lab.compile_report/1"

# Report key -> qualified op names counted under it (sp_lab's CPU ops and PyTorch's CUDA kernels alike).
COUNTED_OPS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("_c10d_functional::all_reduce",),
    "reduce_scatter": ("_c10d_functional::reduce_scatter_tensor",),
    "all_gather": ("_c10d_functional::all_gather_into_tensor",),
    "fused_all_gather_matmul": ("sp_lab::fused_all_gather_matmul", "symm_mem::fused_all_gather_matmul"),
    "fused_matmul_reduce_scatter": ("sp_lab::fused_matmul_reduce_scatter", "symm_mem::fused_matmul_reduce_scatter"),
    "mm": ("aten::mm", "aten::addmm"),
}
_KEY_OF = {name: key for key, names in COUNTED_OPS.items() for name in names}
_NORM_OPS = {"aten::rsqrt", "aten::mean", "aten::var_mean", "aten::native_layer_norm", "aten::rms_norm"}


def _qualified(target: Any) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def op_counts(graph: fx.Graph) -> dict[str, int]:
    """Counts of the collectives, fused ops and matmuls in ``graph`` (keys of :data:`COUNTED_OPS`)."""
    counts = dict.fromkeys(COUNTED_OPS, 0)
    for node in graph.nodes:
        key = _KEY_OF.get(_qualified(node.target)) if node.op == "call_function" else None
        if key:
            counts[key] += 1
    return counts


def node_kind(node: fx.Node, splitting_ops: frozenset[str] = frozenset()) -> str:
    """The explorer's colour class of a node."""
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    name = _qualified(node.target) or ""
    key = _KEY_OF.get(name)
    if key in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        return "fused"
    if key == "mm":
        return "matmul"
    if name.startswith("_c10d_functional::"):
        return "collective"
    if name in splitting_ops:
        return "split"
    if name in _NORM_OPS:
        return "norm"
    return "other"


def shape_json(value: Any) -> list[int | str] | None:
    """A tensor's shape as ints and symbolic expressions (strings), or None for non-tensors."""
    if not isinstance(value, torch.Tensor):
        return None
    return [int(s) if isinstance(s, int) else str(s) for s in value.shape]


def _target_str(node: fx.Node) -> str:
    name = _qualified(node.target)
    if name is not None:
        overload = getattr(node.target, "_overloadname", "")
        return f"{name.replace('::', '.')}.{overload}" if overload else name.replace("::", ".")
    return getattr(node.target, "__name__", str(node.target))


def graph_snapshot(graph: fx.Graph, splitting_ops: frozenset[str] = frozenset()) -> dict[str, list]:
    """Nodes (name, op, target, kind, shape, dtype, module, source) and edges of ``graph``, for the explorer."""
    nodes, edges = [], []
    for node in graph.nodes:
        val = node.meta.get("val")
        nodes.append(
            {
                "name": node.name,
                "op": node.op,
                "target": _target_str(node),
                "kind": node_kind(node, splitting_ops),
                "shape": shape_json(val),
                "dtype": str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else None,
                "module": _module_path(node),
                "source": _source_line(node),
            }
        )
        edges.extend([src.name, node.name] for src in node.all_input_nodes)
    return {"nodes": nodes, "edges": edges}


def _module_path(node: fx.Node) -> str | None:
    """The model's name for where ``node`` comes from (``model.layers.0.mlp.down_proj``), from Dynamo's
    ``nn_module_stack`` (innermost module; Dynamo's ``L['self'].`` prefix dropped)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = str(list(stack.values())[-1][0])
    for prefix in ("L['self'].", "L['self']", "self."):
        path = path.removeprefix(prefix)
    return path or None


def _source_line(node: fx.Node) -> str | None:
    """The innermost frame of the node's stack trace as ``"layers.py:57  return F.linear(x, w)"``."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = trace.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith("File ")]
    if not frames:
        return None
    head = lines[frames[-1]].strip()  # File "/path/layers.py", line 57, in forward
    code = lines[frames[-1] + 1].strip() if frames[-1] + 1 < len(lines) else ""
    try:
        file = head.split('"')[1].rsplit("/", 1)[-1]
        line = head.split(", line ")[1].split(",")[0]
    except IndexError:
        return head
    return f"{file}:{line}  {code}"


def structural_fingerprint(gm: fx.GraphModule, example_inputs: list[Any]) -> str:
    """A hash of a piece's structure and input shapes, blind to node names and weights.

    Two decoder layers' pieces differ only in which weights they read -- and weights are graph inputs -- so
    they share a fingerprint and one compiled artifact serves both.
    """
    index = {node: i for i, node in enumerate(gm.graph.nodes)}

    def arg_repr(arg: Any) -> Any:
        return fx.node.map_aggregate(arg, lambda a: f"%{index[a]}" if isinstance(a, fx.Node) else repr(a))

    parts = [
        (node.op, _target_str(node) if node.op == "call_function" else node.op, arg_repr(node.args), arg_repr(node.kwargs))
        for node in gm.graph.nodes
    ]
    parts.append([(shape_json(x), str(getattr(x, "dtype", type(x).__name__))) for x in example_inputs])
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


class ReportError(ValueError):
    """A saved CompileReport is malformed; the message names the field's path (``ranges[1].pieces[0].lo``)."""


@dataclass
class BoundaryFailure:
    """A piece boundary that SP broke (strategy ``none``)."""

    piece: int
    tensor: str
    check: str  # "assert_size_stride" | "copy_epilogue"
    expected_shape: list | None
    actual_shape: list | None
    message: str
    lo: int | None = None
    hi: int | None = None


@dataclass
class PieceRecord:
    index: int
    name: str
    kind: str  # "compiled" | "splitting_op"
    op: str | None = None
    compile_time_s: float = 0.0
    cache_hit: bool | None = None  # served by an identical piece compiled earlier in this range
    inductor_cache_hit: bool | None = None  # Inductor's FX-graph cache served the compile
    matches: dict[str, int] = field(default_factory=dict)
    op_counts_before: dict[str, int] = field(default_factory=dict)
    op_counts_after: dict[str, int] = field(default_factory=dict)
    graph_before: dict | None = None
    graph_after: dict | None = None
    changed: list[str] = field(default_factory=list)
    fingerprint: str | None = None
    inputs: list[dict] = field(default_factory=list)  # {"name", "shape", "dtype"} as compiled
    outputs: list[dict] = field(default_factory=list)  # {"name", "shape", "dtype", "shape_before", "sharded"}
    async_tp_decisions: list[dict] = field(default_factory=list)
    erased_copies: list[dict] = field(default_factory=list)


@dataclass
class RangeReport:
    lo: int
    hi: int
    enable_sp: bool
    enable_async_tp: bool
    boundary: str
    compile_mode: str
    compiled: bool = False
    compile_time_s: float = 0.0
    pieces: list[PieceRecord] = field(default_factory=list)
    boundaries: list[dict] = field(default_factory=list)
    failures: list[BoundaryFailure] = field(default_factory=list)

    @property
    def erased_copies(self) -> list[dict]:
        return [dict(e, piece=p.index) for p in self.pieces for e in p.erased_copies]

    @property
    def numerically_unsafe(self) -> bool:
        """True when ``gather_erase`` erased a copy: an in-place residual update may have been dropped."""
        return bool(self.erased_copies)

    def op_counts(self) -> dict[str, int]:
        """Ops in the compiled pieces after all passes (identical pieces counted once per use)."""
        total = dict.fromkeys(COUNTED_OPS, 0)
        for piece in self.pieces:
            for key, count in piece.op_counts_after.items():
                total[key] = total.get(key, 0) + count
        return total

    def matches(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for piece in self.pieces:
            for key, count in piece.matches.items():
                total[key] = total.get(key, 0) + count
        return total

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["erased_copies"] = self.erased_copies
        d["numerically_unsafe"] = self.numerically_unsafe
        return d


@dataclass
class CompileReport:
    """Requested and effective configuration, provenance, and one :class:`RangeReport` per token range."""

    requested: dict[str, Any]
    effective: dict[str, Any]
    provenance: dict[str, Any]
    model: dict[str, Any] = field(default_factory=dict)
    ranges: list[RangeReport] = field(default_factory=list)

    def range_for(self, num_tokens: int) -> RangeReport:
        for rng in self.ranges:
            if rng.lo <= num_tokens <= rng.hi:
                return rng
        raise ValueError(
            f"num_tokens={num_tokens} is outside every compile range "
            f"{[(r.lo, r.hi) for r in self.ranges]}"
        )

    def op_counts(self, num_tokens: int) -> dict[str, int]:
        """Collectives and fused ops in the compiled pieces (after all passes) of the range serving ``num_tokens``.

        Raises if that range has not been compiled yet (call the model with such a token count first).
        """
        rng = self.range_for(num_tokens)
        if not rng.compiled:
            raise RuntimeError(
                f"range [{rng.lo}, {rng.hi}] has not been compiled yet: call the compiled model with "
                f"{num_tokens} tokens first"
            )
        return rng.op_counts()

    def sp_rewrites(self, num_tokens: int) -> int:
        matches = self.range_for(num_tokens).matches()
        return sum(matches.get(k, 0) for k in ("sp_first", "sp_middle", "sp_last"))

    def fusion_fired(self, num_tokens: int) -> bool:
        counts = self.op_counts(num_tokens)
        return counts["fused_all_gather_matmul"] + counts["fused_matmul_reduce_scatter"] > 0

    @property
    def failures(self) -> list[BoundaryFailure]:
        return [f for rng in self.ranges for f in rng.failures]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "requested": self.requested,
            "effective": self.effective,
            "provenance": self.provenance,
            "ranges": [r.to_dict() for r in self.ranges],
            "failures": [dataclasses.asdict(f) for f in self.failures],
        }

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CompileReport:
        """Inverse of :meth:`to_dict`. A malformed report raises :class:`ReportError` (a ``ValueError``) naming
        the field's path (e.g. ``ranges[1].pieces[0].op_counts_after``), what it should hold and what it holds."""
        if not isinstance(d, dict):
            raise ReportError(f"compile report: expected a JSON object, got {_json_kind(d)}")
        if d.get("schema") != SCHEMA:
            raise ReportError(f"not an sp_lab compile report: schema {d.get('schema')!r}, expected {SCHEMA!r}")
        _check_keys(d, "", required=("requested", "effective", "provenance", "ranges"),
                    allowed=("schema", "model", "failures"))  # fmt: skip
        for key in ("requested", "effective", "provenance", "model"):
            if key in d:
                _check_json_type(key, d[key], dict)
        _check_json_type("ranges", d["ranges"], list)
        ranges = [
            _dataclass_from_dict(
                RangeReport,
                r,
                f"ranges[{i}]",
                derived=("erased_copies", "numerically_unsafe"),  # recomputed from the pieces
                nested={"pieces": PieceRecord, "failures": BoundaryFailure},
            )
            for i, r in enumerate(d["ranges"])
        ]
        for i, r in enumerate(ranges):
            if not 1 <= r.lo <= r.hi:
                raise ReportError(f"compile report: ranges[{i}]: token range [{r.lo}, {r.hi}] is empty or below 1")
        return cls(d["requested"], d["effective"], d["provenance"], d.get("model", {}), ranges)

    @classmethod
    def from_json(cls, path_or_text: str) -> CompileReport:
        text = path_or_text
        if not path_or_text.lstrip().startswith("{"):
            with open(path_or_text) as f:
                text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"compile report is not valid JSON: {e}") from None
        return cls.from_dict(data)


# -- reading a report back: every field checked, errors name its path ---------------------------------------------


def _json_kind(value: Any) -> str:
    return f"{type(value).__name__} {value!r:.60}"


def _check_keys(data: dict, path: str, *, required: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    where = f"compile report: {path + ': ' if path else ''}"
    unknown = sorted(set(data) - set(required) - set(allowed))
    if unknown:
        raise ReportError(f"{where}unknown field(s) {unknown}; known: {sorted({*required, *allowed})}")
    missing = [key for key in required if key not in data]
    if missing:
        raise ReportError(f"{where}missing field(s) {missing}")


def _check_json_type(path: str, value: Any, expected: Any) -> None:
    """Raise ``ReportError("compile report: <path>: expected <type>, got <kind> <value>")`` unless it fits."""
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        (expected,) = [a for a in args if a is not type(None)]
        origin, args = typing.get_origin(expected), typing.get_args(expected)
    base = origin or expected
    if base is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, base)
    if not ok:
        name = getattr(expected, "__name__", None) if not args else str(expected)
        raise ReportError(f"compile report: {path}: expected {name or expected}, got {_json_kind(value)}")
    if base is dict and args:
        for key, item in value.items():
            _check_json_type(f"{path}[{key!r}]", key, args[0])
            _check_json_type(f"{path}[{key!r}]", item, args[1])
    elif base is list and args:
        for i, item in enumerate(value):
            _check_json_type(f"{path}[{i}]", item, args[0])


def _dataclass_from_dict(
    cls: type, data: Any, path: str, *, derived: tuple[str, ...] = (), nested: dict[str, type] | None = None
) -> Any:
    """``cls(**data)`` after checking every field of ``data`` against ``cls``'s annotations.

    ``derived`` keys are written by ``to_dict`` but recomputed on load (dropped); ``nested`` maps a field to
    the dataclass of its list items.
    """
    if not isinstance(data, dict):
        raise ReportError(f"compile report: {path}: expected an object, got {_json_kind(data)}")
    fields = dataclasses.fields(cls)
    required = tuple(
        f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    _check_keys(data, path, required=required, allowed=(*(f.name for f in fields), *derived))
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        if name in derived:
            continue
        if nested and name in nested:
            _check_json_type(f"{path}.{name}", value, list)
            kwargs[name] = [
                _dataclass_from_dict(nested[name], item, f"{path}.{name}[{i}]") for i, item in enumerate(value)
            ]
        else:
            _check_json_type(f"{path}.{name}", value, hints[name])
            kwargs[name] = value
    return cls(**kwargs)
