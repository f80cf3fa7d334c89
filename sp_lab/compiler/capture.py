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
(``model.training``, a swapped submodule): build a new ``sp_lab.compile`` after changing the model.

The token dimension is dynamic from the first call, 1 included: Dynamo specialises a dimension of size 0 or 1
when it creates its symbol (a plain ``mark_dynamic`` does not stop it), so a 1-token first call marks the
dimension dynamic with a trace hint of its own (``hint_override=TRACE_HINT``): Dynamo creates the symbol and
traces at that hint, and the capture's token guards (not the hint) decide which counts it serves.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.convert_frame import register_bytecode_hook
from torch.utils._pytree import tree_flatten

from sp_lab.compiler.fake_inputs import TRACE_HINT, TokenGuards

__all__ = ["Capture", "call_signature", "capture", "counters"]

counters = {"captures": 0}
"""Dynamo captures started by sp_lab in this process: something tests can assert on."""

_entries = itertools.count()


def _entry(self: torch.nn.Module, tokens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    # ``self``: Dynamo then names the model's modules and weights L['self'].<path>, as it does when it enters a
    # module's own forward (the report's module paths read them so).
    return self(tokens, *args, **kwargs)


@dataclass(frozen=True)
class Capture:
    """One Dynamo capture: ``run(model, tokens, *args, **kwargs)`` calls its bytecode, no guard checked.

    ``token_guards``: what Dynamo's trace assumed about the token count (its guards on that symbol); the
    capture serves the counts that satisfy them.
    """

    run: Callable[..., Any]
    token_guards: TokenGuards


def capture(
    model: torch.nn.Module, backend: Callable, tokens: torch.Tensor, token_dim: int, args: tuple, kwargs: dict,
    token_guards: Callable[[], TokenGuards],
) -> tuple[Any, Capture]:
    """Run ``model(tokens, *args, **kwargs)`` through Dynamo with ``backend``: ``(its output, the capture)``.

    ``token_guards()`` is asked after the trace (the backend knows Dynamo's ShapeEnv).
    """
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

    def keep(old: types.CodeType, new: types.CodeType) -> None:
        if old is code:
            traced.append(new)

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
    with _hook(keep):
        out = compiled(model, tokens, *args, **kwargs)
    if len(traced) != 1:
        raise RuntimeError(f"sp_lab.compile: expected one Dynamo trace of the forward, saw {len(traced)}")
    direct = types.FunctionType(traced[0], scope, code.co_name)  # where Dynamo installed the compiled graph
    return out, Capture(direct, token_guards())


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
