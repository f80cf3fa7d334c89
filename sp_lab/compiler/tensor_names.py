"""The model's own names for the tensors that cross a piece boundary (``residual``, ``positions``, ``q``).

FX names nodes after ops (``getitem_4``, ``add_3``) and Dynamo after the first variable a value was stored
in (the embedding's output is ``hidden`` even where the layer holds it as ``residual``). A person wants the
name the code uses for the tensor *at that boundary*, so this reads it where the value is next used: the
first use after the splitting op, in the Dynamo graph, whose stack trace names the file and line.

From that line the operand the value fills is found with ``ast`` (``x + residual`` -> ``residual``,
``residual.add_(x)`` -> ``residual``, ``attention(q, k, v, ...)`` -> ``q``); a function parameter that the
function never rebinds is followed out to its caller's argument (``RotaryEmbedding.forward(positions, ...)``
called as ``self.rotary_emb(positions, q, k)``), so a name is the outermost one that still denotes the value.
When the source cannot be read the Dynamo name is used, without its ``_3`` suffix.

Names are computed once per range compile, from its Dynamo graph, and looked up by a node's *origin* (its
``source_fn_stack`` entry, which AOT autograd and sp_lab's passes carry onto the aten nodes they make from it), so
every boundary strategy -- the Dynamo-level split and the sharded path's aten-level split -- gives one name.
"""

from __future__ import annotations

import ast
import functools
import linecache
import operator
import re
from dataclasses import dataclass

from torch import fx

from sp_lab.compiler.inspection import _FRAME, _TORCH_DIR, node_module, node_source
from sp_lab.compiler.split import node_op_name

__all__ = ["TensorName", "TensorNames", "origin_key"]

_BINOPS = {operator.add: ast.Add, operator.sub: ast.Sub, operator.mul: ast.Mult, operator.truediv: ast.Div,
           operator.matmul: ast.MatMult, operator.iadd: ast.Add, operator.imul: ast.Mult}


@dataclass(frozen=True)
class TensorName:
    """What a boundary record says about a tensor: the model's name, the module and line that made it."""

    name: str
    module: str | None
    source: str | None


def origin_key(node: fx.Node) -> str:
    """The Dynamo node a node stands for: the name it was created under (kept in ``source_fn_stack``)."""
    stack = node.meta.get("source_fn_stack")
    return str(stack[-1][0]) if stack else node.name


class TensorNames:
    """Names of a Dynamo graph's values at each of its splitting ops (boundary ``k`` = the k-th such op)."""

    def __init__(self, gm: fx.GraphModule, splitting_ops: frozenset[str]):
        self._nodes = list(gm.graph.nodes)
        self._order = {n: i for i, n in enumerate(self._nodes)}
        self._by_origin = {origin_key(n): n for n in self._nodes}
        self._splits = [n for n in self._nodes if node_op_name(n) in splitting_ops]
        self._cache: dict[tuple[int, fx.Node], TensorName] = {}

    def lookup(self, boundary: int, node: fx.Node) -> TensorName:
        """The name of ``node`` (of this or any graph made from it) where it crosses boundary ``boundary``."""
        value = self._by_origin.get(origin_key(node))
        if value is None:  # made by a pass, standing for nothing in the model
            return TensorName(node.name, node_module(node), node_source(node))
        if node.target is operator.getitem and isinstance(value.meta.get("example_value"), (tuple, list)):
            # One item of a multi-output op (``q, k, v = x.split(...)``): Dynamo's getitem of the same index.
            value = next((u for u in value.users if u.target is operator.getitem and u.args[1:] == node.args[1:]),
                         value)
        while _in_place(value):
            value = value.args[0]  # the result of residual.add_(x) is the residual
        return self._name(boundary, value)

    def _name(self, boundary: int, value: fx.Node) -> TensorName:
        if (boundary, value) not in self._cache:
            name = None
            if boundary < len(self._splits):
                cut = self._order[self._splits[boundary]]
                users = sorted((u for u in value.users if self._order[u] >= cut), key=self._order.__getitem__)
                name = _name_at_use(value, users[0]) if users else None
            self._cache[boundary, value] = TensorName(name or _dynamo_name(value), node_module(value),
                                                      node_source(value))
        return self._cache[boundary, value]


def _in_place(node: fx.Node) -> bool:
    """A Tensor method that mutates its receiver (``add_``), whose value lives on under the receiver's name."""
    name = node.target if node.op == "call_method" else ""
    return name.endswith("_") and not name.startswith("_") and bool(node.args) and isinstance(node.args[0], fx.Node)


def _dynamo_name(node: fx.Node) -> str:
    """Dynamo's name without FX's uniquifying suffix (``q_1`` -> ``q``; ``l_input_ids_`` -> ``input_ids``)."""
    name = re.sub(r"_\d+$", "", node.name)
    return re.sub(r"^l_(.*)_$", r"\1", name) or node.name


# -- reading the code --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Frame:
    file: str
    line: int
    function: str
    columns: tuple[int, int] | None  # the expression the frame was executing, from the caret line


def _frames(stack_trace: str | None) -> list[_Frame]:
    """User frames (outside torch) of a stack trace, outermost first."""
    if not stack_trace:
        return []
    lines, frames = stack_trace.splitlines(), []
    for i, text in enumerate(lines):
        m = _FRAME.match(text)
        if not m or m["file"].startswith(_TORCH_DIR):
            continue
        columns = None
        if i + 2 < len(lines) and set(lines[i + 2].strip()) <= set("^~") and lines[i + 2].strip():
            shown, carets = lines[i + 1], lines[i + 2]
            offset = len(linecache.getline(m["file"], int(m["line"]))) - len(
                linecache.getline(m["file"], int(m["line"])).lstrip()) - (len(shown) - len(shown.lstrip()))
            start = len(carets) - len(carets.lstrip())
            columns = (start + offset, len(carets.rstrip()) + offset)
        frames.append(_Frame(m["file"], int(m["line"]), m["function"], columns))
    return frames


@functools.lru_cache(maxsize=64)
def _functions_by_name(file: str) -> dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function of ``file`` by name, parsed and walked once per file: a boundary's names look up a frame for
    each of its tensors' uses, and walking a whole module (transformers' modeling files run to thousands of lines)
    each time cost a few percent of a compile. Empty when the source does not parse."""
    try:
        tree = ast.parse("".join(linecache.getlines(file)))
    except (SyntaxError, ValueError):
        return {}
    functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
    for f in ast.walk(tree):
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.setdefault(f.name, []).append(f)
    return functions


def _function(frame: _Frame) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The innermost function named as the frame's that spans its line."""
    found = [f for f in _functions_by_name(frame.file).get(frame.function, ())
             if f.lineno <= frame.line <= (f.end_lineno or f.lineno)]
    return min(found, key=lambda f: (f.end_lineno or 0) - f.lineno, default=None)


def _calls_at(frame: _Frame, function: ast.AST) -> list[ast.expr]:
    """Call-like expressions on the frame's line, the one under the carets first."""
    found = [e for e in ast.walk(function) if isinstance(e, (ast.Call, ast.BinOp, ast.Subscript))
             and e.lineno <= frame.line <= (e.end_lineno or e.lineno)]
    if frame.columns is not None:
        exact = [e for e in found if e.lineno == frame.line and (e.col_offset, e.end_col_offset) == frame.columns]
        return exact + [e for e in found if e not in exact]
    return found


def _operands(expr: ast.expr, method: bool) -> list[ast.expr]:
    """The expressions that become the FX node's positional args, in order."""
    if isinstance(expr, ast.BinOp):
        return [expr.left, expr.right]
    if isinstance(expr, ast.Subscript):
        return [expr.value, expr.slice]
    receiver = [expr.func.value] if method and isinstance(expr.func, ast.Attribute) else []
    return receiver + list(expr.args)


def _matches(expr: ast.expr, user: fx.Node) -> bool:
    if isinstance(expr, ast.BinOp):
        return user.op == "call_function" and isinstance(expr.op, _BINOPS.get(user.target, ()))
    if isinstance(expr, ast.Subscript):
        return user.target is operator.getitem
    name = user.target if user.op == "call_method" else getattr(user.target, "__name__", None)
    func = expr.func
    return name is not None and (getattr(func, "attr", None) == name or getattr(func, "id", None) == name)


def _name_at_use(value: fx.Node, user: fx.Node) -> str | None:
    frames = _frames(user.meta.get("stack_trace"))
    if not frames:
        return None
    function = _function(frames[-1])
    if function is None:
        return None
    positions = [i for i, a in enumerate(user.args) if a is value]
    keywords = [k for k, a in user.kwargs.items() if a is value]
    for expr in _calls_at(frames[-1], function):
        if not _matches(expr, user):
            continue
        operands = _operands(expr, user.op == "call_method")
        named = [operands[i] for i in positions if i < len(operands)]
        if isinstance(expr, ast.Call):
            named += [kw.value for kw in expr.keywords if kw.arg in keywords]
        name = next((e.id for e in named if isinstance(e, ast.Name)), None)
        if name is not None:
            return _follow_out(name, frames)
    return None


def _follow_out(name: str, frames: list[_Frame]) -> str:
    """Follow a parameter the function never rebinds out to the caller's argument, while it is a plain name."""
    for depth in range(len(frames) - 1, 0, -1):
        function = _function(frames[depth])
        if function is None or not _is_unbound_parameter(name, function):
            return name
        params = [a.arg for a in (*function.args.posonlyargs, *function.args.args)]
        if params and params[0] == "self":
            params = params[1:]
        caller = _function(frames[depth - 1])
        if caller is None:
            return name
        calls = [e for e in _calls_at(frames[depth - 1], caller) if isinstance(e, ast.Call)]
        if not calls:
            return name
        call = calls[0]
        argument = next((kw.value for kw in call.keywords if kw.arg == name), None)
        if argument is None and name in params and params.index(name) < len(call.args):
            argument = call.args[params.index(name)]
        if not isinstance(argument, ast.Name):
            return name
        name = argument.id
    return name


def _is_unbound_parameter(name: str, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    args = function.args
    if name not in {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}:
        return False
    for node in ast.walk(function):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.With)):
            targets = [getattr(node, "target", None)] + [i.optional_vars for i in getattr(node, "items", [])]
        for target in targets:
            if target is not None and any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(target)):
                return False
    return True
