"""Fake inputs for compiling one token range, and the meta-device rewrite of inspect-only compiles."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from sp_lab.compiler.passes.graph_builder import same_size
from sp_lab.compiler.ranges import CompileRange

__all__ = ["meta_devices_to_cpu", "range_inputs"]


def range_inputs(
    example_inputs: list[Any], token_index: int, rng: CompileRange, fake_mode: FakeTensorMode | None, *,
    inspect_only: bool = False, token_dim: int = 0,
) -> tuple[list[Any], FakeTensorMode | None]:
    """Fresh fake inputs for one range: the token count is a new symbol bounded to ``[lo, hi]``.

    Dynamo's inputs carry the hint of whichever call captured the graph. If that was 2 tokens at tp 2, the
    token shard has size 1 and Inductor specialises it (size-1 dims broadcast), baking "2 tokens" into an
    artifact that must serve the whole range -- and guards Inductor adds after Dynamo has finished are never
    checked. Tracing each range with its own bounded symbol and a hint inside the range avoids both.
    The token count is dimension ``token_dim`` of the token input. DTensor inputs (parameters of a model
    parallelised with ``torch.distributed.tensor.parallel``) stay DTensors.
    """
    token = example_inputs[token_index]
    old_size = token.shape[token_dim]

    def device(x: torch.Tensor) -> torch.device:
        # A meta-device model is traced as if on the CPU (fake tensors allocate nothing either way): Inductor's
        # pattern matcher skips nodes whose values live on the meta device, and the report must show the fusions.
        return torch.device("cpu") if inspect_only and x.device.type == "meta" else x.device

    if isinstance(old_size, int):  # Dynamo specialised this graph (1 token): nothing symbolic to re-hint
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
    hi = max(rng.hi // batch, lo + 64)
    hint = max(lo, 61)  # odd and > any tp
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
