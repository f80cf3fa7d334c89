"""Numerics of the multi-rank GPU path, rehearsed with N ranks on one GPU (compile and measure; making the ranks
share the GPU is :mod:`sp_lab.distributed.collectives`' part).

:func:`rehearse_numerics` compiles a model at ``tp_size`` ranks that all share one GPU (a gloo group in
rehearsal mode, :func:`sp_lab.distributed.collectives.rehearse_on_one_gpu`), once per boundary strategy,
and compares its logits with the unsharded (tp 1) eager model on the same GPU. Each row says which fused
symmetric-memory kernels the compile emitted, so a row with SP on and no fused op is visible as such.

What a rehearsal checks: the SP rewrite and AsyncTP fusion with PyTorch's real ``symm_mem`` kernels, their
Inductor lowering, every collective sp_lab emits (gloo, CUDA tensors) and the numerics against tp 1.
What it cannot check: overlap of communication with compute (the ranks take turns on one GPU) and CUDA-graph
capture of the collectives (gloo's run on the host), so no latency measured this way is a multi-GPU latency.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from sp_lab.config import BoundaryStrategy
from sp_lab.vocabulary import REHEARSAL

__all__ = ["BOUNDARIES", "CASES", "RehearsalCase", "RehearsalRow", "rehearse_case", "rehearse_numerics"]

BOUNDARIES = tuple(BoundaryStrategy)
"""Every boundary strategy ``LabConfig.boundary`` accepts, in the order a rehearsal compiles them."""


@dataclasses.dataclass(frozen=True)
class RehearsalCase:
    """One model a rehearsal checks, with the token counts, the SP threshold and the error it must stay within."""

    model: str
    """Zoo model name."""
    num_layers: int | None
    """Layers to build (None: the model's own count)."""
    overrides: Mapping[str, Any]
    """Other ``sp_lab.models.build`` overrides."""
    dtype: torch.dtype
    """Parameter dtype."""
    token_counts: tuple[int, ...]
    """One count below ``async_tp_min_tokens`` (no SP) and one above."""
    async_tp_min_tokens: int
    """Where SP + AsyncTP start."""
    bound: float
    """Largest |logits - tp 1 logits| accepted, for the compiled and the eager tp-way model alike."""


# Bounds: in fp32 sharding only reorders sums (~1e-6 seen). In bf16 the logits of a random 2-layer model reach
# |x| ~ 5 and eager tp 2 already differs from tp 1 by ~0.07 there, so the compiled path must stay within 0.25.
CASES = {
    # 4 KV heads so that tp 4 divides them
    "toy": RehearsalCase("toy", None, {"num_kv_heads": 4}, torch.float32, (13, 40), 16, 1e-4),
    "llama-3-8b/2L": RehearsalCase("llama-3-8b", 2, {}, torch.bfloat16, (13, 96), 64, 0.25),
}
"""The models a GPU rehearsal checks (the GPU tests and ``benchmarks/h200/rehearsal_numerics.py`` alike)."""


@dataclasses.dataclass(frozen=True)
class RehearsalRow:
    """One (model, tp, boundary, token count) of a rehearsal: error vs tp 1 and the fused ops emitted."""

    model: str
    """Model name (``ModelSpec.name``) with its layer count, e.g. ``"llama-3-8b/2L"``."""
    dtype: str
    """Parameter dtype."""
    tp: int
    """Ranks, all on one GPU."""
    boundary: str
    """``LabConfig.boundary`` of this compile."""
    num_tokens: int
    """Tokens of the call."""
    sp_active: bool
    """SP (and AsyncTP) applied in the compile range serving this call."""
    max_abs_err: float | None
    """max |logits - tp 1 eager logits| of the compiled tp-way model; None when the compile failed."""
    eager_max_abs_err: float
    """The same for the uncompiled tp-way model: the rounding that sharding alone causes."""
    fused_all_gather_matmul: int
    """``symm_mem::fused_all_gather_matmul`` nodes in the compiled graphs of this range."""
    fused_matmul_reduce_scatter: int
    """``symm_mem::fused_matmul_reduce_scatter`` nodes in the compiled graphs of this range."""
    fused_op_impl: str
    """``EffectiveConfig.fused_op_impl`` (``"symm_mem"`` in a working rehearsal)."""
    error: str = ""
    """The exception, when the compile or the call raised (expected for boundary ``"none"`` under SP)."""
    source: str = REHEARSAL
    """Where the numbers come from: always ``"rehearsal"``."""

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return dataclasses.asdict(self)


def rehearse_numerics(
    model_name: str,
    *,
    tp_size: int,
    token_counts: Sequence[int],
    async_tp_min_tokens: int,
    boundaries: Sequence[str] = BOUNDARIES,
    dtype: torch.dtype = torch.float32,
    num_layers: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    seed: int = 0,
    timeout: float = 600.0,
) -> list[RehearsalRow]:
    """Compile ``model_name`` at ``tp_size`` ranks sharing this machine's GPU, once per boundary strategy.

    The tp 1 reference runs here first (eager, on ``cuda:0``); then :func:`sp_lab.launch` starts ``tp_size``
    gloo ranks in rehearsal mode, each building its shard of the same random model (``seed``) and compiling
    it with SP + AsyncTP from ``async_tp_min_tokens`` on. Returns one row per boundary and token count.

    Raises RuntimeError without CUDA; ValueError for unknown boundaries or none, and for no token counts or one
    below 1; :class:`sp_lab.distributed.launch.RankError` if a rank fails outside a compile.
    """
    from sp_lab.distributed.launch import launch
    from sp_lab.models import build

    if not torch.cuda.is_available():
        raise RuntimeError("rehearse_numerics needs a CUDA GPU: the rehearsal runs the symm_mem kernels")
    unknown = [b for b in boundaries if b not in BOUNDARIES]
    if unknown or not boundaries:
        raise ValueError(f"boundaries: unknown or none {unknown or list(boundaries)}; choose from {BOUNDARIES}")
    tokens = sorted({int(t) for t in token_counts})
    if not tokens or tokens[0] < 1:
        raise ValueError(f"token_counts must be positive ints, got {list(token_counts)}")
    build_args = dict(num_layers=num_layers, dtype=dtype, seed=seed, **dict(overrides or {}))
    reference = build(model_name, device="cuda", **build_args)
    ids = {t: torch.randint(0, reference.spec.vocab_size, (t,), generator=torch.Generator().manual_seed(t))
           for t in tokens}
    with torch.no_grad():
        want = {t: reference(ids[t].cuda()).float().cpu() for t in tokens}
    name = f"{reference.spec.name}/{reference.spec.num_layers}L"
    del reference
    torch.cuda.empty_cache()
    # The reference travels with the job through the launcher's own private channel: no second file
    # format, and nothing in sp_lab unpickles a file it did not write for its own ranks.
    results = launch(
        _rank, model_name, {"ids": ids, "logits": want}, build_args, list(boundaries), async_tp_min_tokens, name,
        world_size=tp_size, backend="gloo", timeout=timeout,
    )
    return results[0]


def rehearse_case(case: RehearsalCase, tp_size: int, *, timeout: float = 600.0) -> list[RehearsalRow]:
    """:func:`rehearse_numerics` for one of :data:`CASES` at ``tp_size`` ranks."""
    return rehearse_numerics(case.model, tp_size=tp_size, token_counts=case.token_counts,
                             async_tp_min_tokens=case.async_tp_min_tokens, dtype=case.dtype,
                             num_layers=case.num_layers, overrides=case.overrides, timeout=timeout)


def _rank(model_name: str, reference: dict[str, dict[int, torch.Tensor]], build_args: dict, boundaries: list[str],
          async_tp_min_tokens: int, name: str) -> list[RehearsalRow] | None:
    """One rehearsal rank: build the shard, eager error, then compile and check each boundary strategy."""
    import torch.distributed as dist

    from sp_lab.compiler.backend import BoundaryError
    from sp_lab.compiler.backend import compile as compile_model
    from sp_lab.config import LabConfig
    from sp_lab.distributed.collectives import rehearse_on_one_gpu
    from sp_lab.models import build

    device = rehearse_on_one_gpu()
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = sorted(reference["ids"])
    model = build(model_name, tp_rank=rank, tp_size=world, device=device, **build_args)
    dtype = str(build_args["dtype"]).removeprefix("torch.")

    def error(logits: torch.Tensor, t: int) -> float:
        return float((logits.float().cpu() - reference["logits"][t]).abs().max())

    with torch.no_grad():
        eager = {t: error(model(reference["ids"][t].to(device)), t) for t in tokens}
    rows = []
    for boundary in boundaries:
        config = LabConfig(tp_size=world, boundary=boundary, async_tp_min_tokens=async_tp_min_tokens,
                                  max_num_tokens=max(tokens[-1], async_tp_min_tokens))
        compiled = compile_model(model, config)
        for t in tokens:
            failure, err = "", None
            try:
                err = error(compiled(reference["ids"][t].to(device)), t)
            except BoundaryError as e:  # the failure boundary "none" exists to show
                failure = f"BoundaryError: {str(e).splitlines()[0][:300]}"
            counts = compiled.report.op_counts(t) if compiled.report.range_for(t).compiled else {}
            rows.append(RehearsalRow(
                model=name, dtype=dtype, tp=world, boundary=boundary, num_tokens=t,
                sp_active=config.sp_active_for(config.range_for(t)) and compiled.effective.enable_sp,
                max_abs_err=err, eager_max_abs_err=eager[t],
                fused_all_gather_matmul=counts.get("fused_all_gather_matmul", 0),
                fused_matmul_reduce_scatter=counts.get("fused_matmul_reduce_scatter", 0),
                fused_op_impl=compiled.effective.fused_op_impl, error=failure,
            ))
    return rows if rank == 0 else None
