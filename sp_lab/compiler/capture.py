"""One Dynamo capture per model, then calls that never re-enter Dynamo (vLLM's design).

Dynamo turns the entry frame ``model(tokens, *args, **kwargs)`` into new bytecode that gathers the graph's
inputs (the tokens, the parameters), calls the backend's callable and rebuilds the model's outputs (a
``ModelOutput``, a tuple). :class:`Capture` runs Dynamo once, keeps that bytecode
(``torch._dynamo.convert_frame.register_bytecode_hook``), and calls it directly afterwards: no guard is
evaluated on the call path, so a 1-token forward pays nothing for them, and Dynamo's cache (and its recompile
limit, shared by every compile of one ``forward``) is not involved. vLLM's ``TorchCompileWrapperWithCustomDispatcher``
did the same with the forward's ``__code__``.

Dropping Dynamo's guards is sound for what sp_lab compiles because it re-checks what they would have:
:func:`call_signature` (the shapes, dtypes and devices of every tensor argument but the token dimension, the
other arguments' values) picks a capture, and the guards Dynamo's trace put on the token count
(:class:`~sp_lab.compiler.fake_inputs.TokenGuards`, e.g. "tp divides N") decide whether it serves a count; a
call that fits no capture is captured afresh. What no check sees: a module attribute changed between calls
(``model.training``, a swapped submodule): build a new ``sp_lab.compile`` (and a new :class:`SharedCaptures`)
after changing the model.

One capture serves every variant of a model: the graph Dynamo hands over depends on the model and the call, not
on sp_lab's config (the passes, the ranges and the boundary run on it afterwards). A :class:`SharedCaptures`
passed to several ``sp_lab.compile`` of one model (a sweep's variants) keeps each capture once; every compiled
model adopts it with a dispatch of its own, and the captured bytecode calls the dispatch of the compiled model
running it (:class:`_Route`).

The token dimension is dynamic from the first call, 1 included: Dynamo specialises a dimension of size 0 or 1
when it creates its symbol (a plain ``mark_dynamic`` does not stop it), so a 1-token first call marks the
dimension dynamic with a trace hint of its own (``hint_override=TRACE_HINT``): Dynamo creates the symbol and
traces at that hint, and the capture's token guards (not the hint) decide which counts it serves.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch._dynamo.convert_frame import register_bytecode_hook
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_flatten

from sp_lab.compiler.fake_inputs import TRACE_HINT, TokenGuards

__all__ = ["Capture", "CapturedGraph", "SharedCaptures", "call_signature", "capture", "counters"]

counters = {"captures": 0}
"""Dynamo captures started by sp_lab in this process: something tests can assert on."""

_entries = itertools.count()

Dispatch = Callable[..., Any]
"""What serves a captured graph's calls for one compiled model: its range artifacts, picked by token count."""


def _entry(self: torch.nn.Module, tokens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    # ``self``: Dynamo then names the model's modules and weights L['self'].<path>, as it does when it enters a
    # module's own forward (the report's module paths read them so).
    return self(tokens, *args, **kwargs)


@dataclass(frozen=True)
class CapturedGraph:
    """The graph Dynamo handed sp_lab, and what sp_lab reads off it once for every compiled model using it.

    ``example_inputs``: the placeholders' fake values (the token count symbolic); ``token_index``: which input
    holds the tokens; ``token_guards``: what Dynamo's trace assumed about the token count (its guards on that
    symbol): the capture serves the counts that satisfy them. ``capture_time_s``: from the call that started
    the capture to the graph reaching sp_lab.
    """

    gm: fx.GraphModule
    example_inputs: list[Any]
    fake_mode: Any
    token_index: int
    token_guards: TokenGuards
    capture_time_s: float


class _Route:
    """The callable Dynamo installs in the captured bytecode: it calls the dispatch of the compiled model that
    runs the capture now (per thread), so variants sharing one capture each reach their own artifacts."""

    def __init__(self) -> None:
        self._local = threading.local()

    def run(self, dispatch: Dispatch, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with ``dispatch`` serving the graph's calls (on the hot path: no generator)."""
        local = self._local
        previous = getattr(local, "dispatch", None)
        local.dispatch = dispatch
        try:
            return fn(*args, **kwargs)
        finally:
            local.dispatch = previous

    def __call__(self, *args: Any) -> Any:
        return self._local.dispatch(*args)


@dataclass(frozen=True)
class Capture:
    """One Dynamo capture: its graph, and bytecode that runs a call without Dynamo (no guard checked).

    ``run(dispatch, model, tokens, *args, **kwargs)`` calls the bytecode with ``dispatch`` serving the graph.
    """

    graph: CapturedGraph
    _bytecode: Callable[..., Any]
    _route: _Route

    @property
    def token_guards(self) -> TokenGuards:
        return self.graph.token_guards

    def run(self, dispatch: Dispatch, model: torch.nn.Module, tokens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self._route.run(dispatch, self._bytecode, model, tokens, *args, **kwargs)


def capture(
    model: torch.nn.Module, tokens: torch.Tensor, token_dim: int, args: tuple, kwargs: dict, *,
    adopt: Callable[[CapturedGraph], Dispatch], keep: Callable[[Capture, Dispatch], None],
) -> Any:
    """Run ``model(tokens, *args, **kwargs)`` through Dynamo and return its output.

    ``adopt(graph)`` is called once Dynamo hands the graph over, and returns the dispatch that serves this call
    (and, through the capture, later ones of the same compiled model). ``keep(capture, dispatch)`` receives the
    capture and that dispatch after the call, also when running it raised once Dynamo had traced it (a range that failed to compile):
    another config may well compile from the same graph.
    """
    started = time.perf_counter()
    # A code object of its own per capture: Dynamo keys its cache by code object, and the hook must find
    # this trace's bytecode, not another compile's of the same forward.
    code = _entry.__code__.replace(co_name=f"_sp_lab_entry_{next(_entries)}")
    # The entry frame runs in the globals of the model's forward. Dynamo resolves a global of an inlined function
    # whose globals are not the root frame's by importing its module by name, and a forward defined in a notebook
    # and sent to the ranks by value (cloudpickle) names ``__main__``, where the rank finds none of the notebook's
    # names (``F``). ``_entry`` itself reads no global.
    scope = _globals_of(model)
    entry = types.FunctionType(code, scope, code.co_name)
    traced: list[types.CodeType] = []
    adopted: list[tuple[CapturedGraph, Dispatch]] = []  # the graph, once adopt() has made its dispatch
    route = _Route()

    def on_bytecode(old: types.CodeType, new: types.CodeType) -> None:
        if old is code:
            traced.append(new)

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        fake_mode = detect_fake_mode(example_inputs)
        token_index = _token_input_index(gm, example_inputs, tokens)
        # Dynamo hands over real tensors; the symbolic shapes live in the placeholders' fake values.
        example_inputs = [
            n.meta.get("example_value", x)
            for n, x in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs)
        ]
        size = example_inputs[token_index].shape[token_dim]
        graph = CapturedGraph(gm, example_inputs, fake_mode, token_index,
                              TokenGuards.of(fake_mode.shape_env if fake_mode else None, size),
                              time.perf_counter() - started)
        adopted.append((graph, adopt(graph)))
        return route

    # Dynamo's guards are never evaluated (calls run the bytecode directly), and they would fail at once on a
    # 1-token call traced at TRACE_HINT (its symbol ranges from 2): none is kept.
    compiled = torch.compile(entry, backend=backend, fullgraph=True, dynamic=False,
                             options={"guard_filter_fn": lambda guards: [False] * len(guards)})
    if tokens.shape[token_dim] > 1:
        torch._dynamo.maybe_mark_dynamic(tokens, token_dim)
    else:
        # Dynamo specialises sizes 0 and 1 when it creates their symbol; a hint of its own makes it create one.
        torch._dynamo.mark_dynamic(tokens, token_dim, hint_override=TRACE_HINT)
    counters["captures"] += 1
    # The call runs the graph as soon as the backend returns: the route serves it with the dispatch adopt() made.
    with _hook(on_bytecode):
        try:
            out = route.run(lambda *a: adopted[-1][1](*a), compiled, model, tokens, *args, **kwargs)
        finally:
            if len(traced) == 1 and len(adopted) == 1:
                (graph, dispatch), = adopted
                # Where Dynamo installed the compiled graph: its bytecode, in the entry's globals.
                keep(Capture(graph, types.FunctionType(traced[0], scope, code.co_name), route), dispatch)
    if len(traced) != 1 or len(adopted) != 1:
        raise RuntimeError(f"sp_lab.compile: expected one Dynamo trace of the forward, saw {len(traced)} "
                           f"with {len(adopted)} graphs")
    return out


class SharedCaptures:
    """The Dynamo captures of one model, shared by the ``sp_lab.compile`` of its variants.

    Pass one to every ``sp_lab.compile(model, config, captures=...)`` of the same model (a sweep does for its
    variants): the first call at a new signature captures, the others reuse that graph and compile only their
    own ranges. Reuse keys on the call signature and the process group; a model changed
    between the compiles (a swapped submodule, another attribute its forward reads) needs a store of its own.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._captures: dict[tuple, list[Capture]] = {}

    def find(self, key: tuple, seq: int) -> Capture | None:
        """A capture made at ``key`` whose token guards hold for ``seq`` tokens, if any."""
        return next((c for c in self._captures.get(key, ()) if c.token_guards.hold(seq)), None)

    def add(self, key: tuple, captured: Capture) -> None:
        self._captures.setdefault(key, []).append(captured)

    def __len__(self) -> int:
        return sum(len(c) for c in self._captures.values())

    @staticmethod
    def key(signature: tuple) -> tuple:
        """What a shared capture must match besides the token count: the call (its signature, which places the
        token dimension) and the process group its collectives name (backend, name, size)."""
        group = ((dist.get_backend(), dist.group.WORLD.group_name, dist.get_world_size()) if dist.is_initialized()
                 else None)
        return signature, group


def _token_input_index(gm: fx.GraphModule, example_inputs: list[Any], tokens: torch.Tensor) -> int:
    """Which input of Dynamo's graph is the token tensor the caller passed first.

    Found by identity (Dynamo hands the backend the caller's own tensors), not by the forward argument's name:
    the name Dynamo records depends on how it entered the module. ``forward(self, x)`` gives a local ``x``, but a
    ``forward(*args)``, and every ``torch.nn`` container such as ``nn.Sequential`` (whose ``forward(input)``
    Dynamo enters through a ``*args`` wrapper), give ``args[0]``.
    """
    for i, x in enumerate(example_inputs):
        if x is tokens:
            return i
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    raise RuntimeError(
        f"sp_lab.compile: the token tensor passed first is not among the captured graph's inputs {placeholders}; "
        "the forward must use its first argument (the tokens) as a tensor"
    )


def _globals_of(model: torch.nn.Module) -> dict[str, Any]:
    forward = getattr(type(model), "forward", None)
    return getattr(forward, "__globals__", None) or _entry.__globals__


def call_signature(tokens: torch.Tensor, token_dim: int, args: tuple, kwargs: dict) -> tuple:
    """What a capture's bytecode assumed about a call, besides the token count: a hashable key.

    Tensors by shape (the token dimension left out of ``tokens``), dtype, device and grad; anything else by
    its value (Dynamo would have specialised on it).
    """
    shape = list(tokens.shape)
    shape[token_dim] = -1
    leaves, spec = tree_flatten((args, kwargs))
    return (_tensor_key(tokens, tuple(shape)), str(spec),
            tuple(_tensor_key(x, tuple(x.shape)) if isinstance(x, torch.Tensor) else _value_key(x) for x in leaves))


def _tensor_key(x: torch.Tensor, shape: tuple) -> tuple:
    return ("tensor", shape, x.dtype, x.device, x.requires_grad)


def _value_key(x: Any) -> Any:
    try:
        hash(x)
    except TypeError:
        return ("id", _Identity(x))
    return (type(x).__name__, x)


class _Identity:
    """An unhashable argument in a call signature, equal only to itself. The signature keeps it alive, so that no
    other object can take its ``id`` while a capture specialised on it is kept."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


@contextlib.contextmanager
def _hook(fn: Callable[[types.CodeType, types.CodeType], None]) -> Iterator[None]:
    """``register_bytecode_hook`` for the duration of the block."""
    handle = register_bytecode_hook(fn)
    try:
        yield
    finally:
        handle.remove()
