"""Fake inputs for compiling one token range, what its trace assumed about the token count, and the
meta-device rewrite of inspect-only compiles."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy
import torch
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from sp_lab.compiler.passes.graph_builder import same_size
from sp_lab.compiler.ranges import CompileRange

if TYPE_CHECKING:
    from torch.fx.experimental.symbolic_shapes import ShapeEnv as ShapeEnvType

__all__ = ["TRACE_HINT", "TokenGuards", "meta_devices_to_cpu", "range_inputs"]

# The preferred trace hint: odd and larger than any tp, so that no shard size is degenerate (0 or 1) and no
# divisibility by tp is assumed unless the graph itself demands it (see ``TokenGuards``).
TRACE_HINT = 61
# How far past the preferred hint to look for one that the Dynamo graph's guards accept.
_HINT_SEARCH = 1024


@dataclass(frozen=True)
class TokenGuards:
    """What a trace assumed about the token count ``N``: the guards of its ShapeEnv on N's symbol alone.

    A graph traced with one hint is valid for exactly the counts that satisfy them. A model whose token
    shards are made with ``DTensor.from_local`` and no global shape (torchtitan's ``SequenceParallel``)
    takes the global size as tp x the local shard, so its graph holds only when tp divides N, and the trace
    records ``Eq(Mod(N, tp), 0)``. Dynamo checks the guards of its own graph before calling the backend;
    those of sp_lab's re-trace (a fresh ShapeEnv per range) nobody checks, so the range dispatch does.
    """

    symbol: sympy.Symbol | None = None
    exprs: tuple[sympy.Basic, ...] = ()

    @classmethod
    def of(cls, shape_env: ShapeEnvType | None, size: Any) -> TokenGuards:
        """The guards of ``shape_env`` on the symbol of ``size`` (a SymInt); none for a static size."""
        if shape_env is None or not isinstance(size, torch.SymInt) or not isinstance(size.node.expr, sympy.Symbol):
            return cls()
        symbol = size.node.expr
        exprs = []
        for guard in shape_env.guards:
            expr = guard.expr
            if expr.free_symbols == {symbol} and expr not in exprs:
                exprs.append(expr)
        return cls(symbol, tuple(exprs))

    def violated(self, num_tokens: int) -> list[str]:
        """The guards ``num_tokens`` violates, written in ``N``."""
        if self.symbol is None:
            return []
        value = {self.symbol: sympy.Integer(num_tokens)}
        return [self._in_n(e) for e in self.exprs if not bool(e.xreplace(value))]

    def hold(self, num_tokens: int) -> bool:
        return not self.violated(num_tokens)

    def describe(self) -> list[str]:
        """Every guard, written in ``N`` (for the report and error messages)."""
        return [self._in_n(e) for e in self.exprs]

    def _in_n(self, expr: sympy.Basic) -> str:
        return str(expr.xreplace({self.symbol: sympy.Symbol("N", integer=True, positive=True)}))


def _trace_hint(lo: int, dynamo: TokenGuards) -> int:
    """The token count to trace a range with: the preferred hint (or ``lo`` above it), else the nearest count
    the Dynamo graph's guards accept (the graph is only valid there: DTensor shards made with ``from_local``
    are sized assuming tp divides N)."""
    start = max(lo, TRACE_HINT)
    for hint in itertools.chain(range(start, start + _HINT_SEARCH), range(start - 1, lo - 1, -1)):
        if dynamo.hold(hint):
            return hint
    raise ValueError(
        f"no token count in [{lo}, {start + _HINT_SEARCH}) satisfies the captured graph's guards "
        f"{dynamo.describe()}: sp_lab cannot choose a count to trace the range starting at {lo} with"
    )


def range_inputs(
    example_inputs: list[Any], token_index: int, rng: CompileRange, fake_mode: FakeTensorMode | None, *,
    inspect_only: bool = False, token_dim: int = 0, hint: int | None = None,
) -> tuple[list[Any], FakeTensorMode | None]:
    """Fresh fake inputs for one range: the token count is a new symbol bounded to ``[lo, hi]``.

    Dynamo's inputs carry the hint of whichever call captured the graph. If that was 2 tokens at tp 2, the
    token shard has size 1 and Inductor specialises it (size-1 dims broadcast), baking "2 tokens" into an
    artifact that must serve the whole range -- and guards Inductor adds after Dynamo has finished are never
    checked. Tracing each range with its own bounded symbol and a hint inside the range avoids both.
    The token count is dimension ``token_dim`` of the token input. DTensor inputs (parameters of a model
    parallelised with ``torch.distributed.tensor.parallel``) stay DTensors.

    ``hint``: the token count to trace with; by default one that the guards Dynamo recorded for the captured
    graph accept (:func:`_trace_hint`). The fresh ShapeEnv records what this trace assumes
    (:class:`TokenGuards`), which the caller must check before serving a count with the artifact.
    """
    token = example_inputs[token_index]
    old_size = token.shape[token_dim]

    def device(x: torch.Tensor) -> torch.device:
        # A meta-device model is traced as if on the CPU (fake tensors allocate nothing either way): Inductor's
        # pattern matcher skips nodes whose values live on the meta device, and the report must show the fusions.
        return torch.device("cpu") if inspect_only and x.device.type == "meta" else x.device

    if isinstance(old_size, int):  # a graph traced for one count (static): nothing symbolic to re-hint
        if not inspect_only or fake_mode is None:
            return example_inputs, fake_mode
        # only the devices change
        return [_fresh_fake(x, fake_mode, device) if isinstance(x, torch.Tensor) else x for x in example_inputs], \
            fake_mode
    # The symbol's bounds only inform Inductor; widening the top keeps tiny ranges (e.g. [2, tp + 1]) from
    # being specialised to one size, and lets the hint sit where no shard size is degenerate.
    # Ranges count batch * seq tokens (LabConfig.num_tokens); the symbol is seq, the batch is static.
    batch = 1
    for size in token.shape[:token_dim]:
        batch *= int(size)
    lo = max(-(-rng.lo // batch), 2)
    if hint is None:
        hint = _trace_hint(lo, TokenGuards.of(fake_mode.shape_env if fake_mode else None, old_size))
    hi = max(rng.hi // batch, lo + 64, hint)
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    shape = list(token.shape)
    shape[token_dim] = hint
    new_token = mode.from_tensor(
        torch.empty(shape, dtype=token.dtype, device="meta"),
        symbolic_context=StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC if d == token_dim else DimDynamic.STATIC for d in range(token.dim())]
        ),
        source=ConstantSource("sp_lab_num_tokens"),
    )
    symbol = new_token.shape[token_dim]
    mode.shape_env.constrain_symbol_range(symbol.node.expr, compiler_min=lo, compiler_max=hi)
    inputs = []
    for i, x in enumerate(example_inputs):
        if i == token_index:
            with mode:
                inputs.append(torch.empty(new_token.shape, dtype=token.dtype, device=device(token)))
        elif isinstance(x, torch.SymInt):
            inputs.append(symbol if same_size(x, old_size) else int(x.node.hint))
        elif isinstance(x, torch.Tensor):
            if any(not isinstance(d, int) for d in x.shape):
                raise NotImplementedError(
                    f"graph input {i} has a symbolic shape {tuple(x.shape)} besides the token input; sp_lab "
                    "compiles one symbolic token dimension per range"
                )
            inputs.append(_fresh_fake(x, mode, device))
        else:
            inputs.append(x)
    return inputs, mode


def _fresh_fake(x: torch.Tensor, mode: FakeTensorMode, device: Callable[[torch.Tensor], torch.device]) -> torch.Tensor:
    """A fake tensor of ``mode`` like ``x``. A DTensor stays a DTensor (its local shard made afresh): the graph
    mixes it with DTensors made inside (``DTensor.from_local``), and AOT autograd turns the whole DTensor program
    into a plain aten graph with functional collectives, which the passes then see."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        local = _fresh_fake(x._local_tensor, mode, device)
        with mode:
            return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                      stride=x.stride())
    with mode:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device(x))


def meta_devices_to_cpu(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose device constants say "cpu" where they said "meta" (see :func:`range_inputs`)."""
    graph = copy.deepcopy(gm.graph)
    meta = torch.device("meta")

    def to_cpu(value: Any) -> Any:
        return torch.device("cpu") if isinstance(value, torch.device) and value == meta else value

    for node in graph.nodes:
        node.args = fx.node.map_aggregate(node.args, to_cpu)
        node.kwargs = fx.node.map_aggregate(node.kwargs, to_cpu)
    return fx.GraphModule(gm, graph)
