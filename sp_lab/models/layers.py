"""Tensor-parallel building blocks written with PyTorch functional collectives.

Every collective goes through ``torch.distributed._functional_collectives`` on the default (WORLD)
group, so Dynamo records it as a node in the captured graph (``_c10d_functional.all_reduce`` +
``wait_tensor``) where the sequence-parallel and AsyncTP passes can see and rewrite it. With
``tp.size == 1`` no collective is emitted at all.

Layout follows vLLM: activations are ``[num_tokens, hidden]`` (one flattened sequence, no batch dim).

Each layer also declares how its local parameters are cut from the full, unsharded tensors of a
Hugging Face checkpoint (:meth:`checkpoint_plan`), so random initialisation and checkpoint loading
share one sharding code path (:mod:`sp_lab.models.checkpoint`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from sp_lab.models.fp8 import FP8_DTYPE, Fp8Scheme, quantize_weight, requantize_parts, scaled_linear

# all_gather_single replaced all_gather_tensor (deprecated in torch 2.13); take whichever this torch has.
_all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor

__all__ = [
    "ColumnParallelLinear",
    "ParallelLMHead",
    "ParamPlan",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "TensorParallel",
    "TensorSlice",
    "VocabParallelEmbedding",
    "gather_last_dim",
    "silu_and_mul",
]


# --------------------------------------------------------------------------------------------------
# Tensor-parallel context and the sharding plan
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorParallel:
    """Where this rank sits in the tensor-parallel group (always the default WORLD group)."""

    rank: int = 0
    """This rank's index in the group, ``0 <= rank < size``."""
    size: int = 1
    """Number of ranks the weights are sharded over; 1 means unsharded and collective-free."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"tp_size={self.size} must be >= 1")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp_rank={self.rank} must lie in [0, tp_size={self.size})")

    def shard(self, full: int, what: str) -> int:
        """Size of this rank's shard of a dimension of ``full`` elements; raise if it does not divide.

        ``what`` names the dimension in the error, e.g. ``"num_kv_heads"``.
        """
        if full % self.size:
            # Only this dimension is known here; a whole model's sizes come from DecoderConfig.tp_sizes().
            divisors = [d for d in range(1, min(full, 64) + 1) if full % d == 0]
            raise ValueError(
                f"tp_size={self.size} does not divide {what}={full}; tensor parallelism needs every "
                f"rank to hold an equal share. tp_size values that divide {what}: {divisors}"
            )
        return full // self.size

    def group(self) -> dist.ProcessGroup:
        """The process group collectives run on (WORLD); checked so a missing init fails clearly."""
        if not dist.is_initialized():
            raise RuntimeError(
                f"this model was built with tp_size={self.size} but torch.distributed is not initialised; "
                "call it inside sp_lab.launch(...) or after dist.init_process_group(...)"
            )
        return dist.group.WORLD


@dataclass(frozen=True)
class TensorSlice:
    """One contiguous slice of one full (unsharded) checkpoint tensor."""

    name: str
    """Hugging Face tensor name, e.g. ``"model.layers.0.self_attn.q_proj.weight"``."""
    full_shape: tuple[int, ...]
    """Shape of the whole tensor in the checkpoint."""
    dim: int | None = None
    """Dimension the slice is cut along; ``None`` takes the whole tensor (replicated parameters)."""
    start: int = 0
    """First index along ``dim`` (inclusive)."""
    stop: int = 0
    """Last index along ``dim`` (exclusive)."""
    init: Literal["normal", "ones", "zeros"] = "normal"
    """How random initialisation fills it (checkpoints ignore this)."""

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the slice itself."""
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.dim] = self.stop - self.start
        return tuple(shape)


@dataclass(frozen=True)
class ParamPlan:
    """How one local parameter is assembled: its slices concatenated along dim 0, in order."""

    param: str
    """Attribute name of the parameter on the module (``"weight"`` or ``"bias"``)."""
    slices: tuple[TensorSlice, ...]
    """The pieces; fused parameters (QKV, gate_up) have several, everything else one."""


def qualify(parent: str, name: str) -> str:
    """Join a parent module path and a child name the way ``named_modules`` does (``"" + "x" -> "x"``)."""
    return f"{parent}.{name}" if parent else name


def _shard_slice(name: str, full_shape: Sequence[int], dim: int, tp: TensorParallel, **kw) -> TensorSlice:
    step = full_shape[dim] // tp.size
    return TensorSlice(name, tuple(full_shape), dim, tp.rank * step, (tp.rank + 1) * step, **kw)


def _parameter(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Inference only: no autograd state, so captured graphs are forward-only.
    return nn.Parameter(torch.empty(tuple(shape), dtype=dtype, device=device), requires_grad=False)


# --------------------------------------------------------------------------------------------------
# Linear layers
# --------------------------------------------------------------------------------------------------


class _Linear(nn.Module):
    """What column- and row-parallel layers share: the matmul, in the model dtype or in FP8.

    FP8 state (:mod:`sp_lab.models.fp8`): ``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale`` float32
    (``[out, 1]`` rowwise; ``[]`` tensorwise) and, tensorwise, the static ``input_scale`` ``[]``. A model
    gets it either by :meth:`quantize_` (random weights drawn in high precision, then quantised) or by
    loading a checkpoint's FP8 tensors into a layer built with ``quant`` and then :meth:`fuse_scales_`.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    quant: Fp8Scheme | None
    out_dtype: torch.dtype

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return F.linear(x, self.weight, self.bias)
        return scaled_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias, self.out_dtype)

    def _init_fp8(self, quant: Fp8Scheme | None, rows: int, cols: int, parts: int, dtype, device) -> None:
        """Parameters in checkpoint layout: tensorwise scales one per fused part until :meth:`fuse_scales_`."""
        self.quant, self.out_dtype = quant, dtype
        self.weight = _parameter((rows, cols), FP8_DTYPE if quant else dtype, device)
        self.input_scale = None
        if quant is not None:
            rowwise = quant.granularity == "rowwise"
            self.weight_scale = _parameter((rows, 1) if rowwise else (parts,), torch.float32, device)
            if not rowwise:
                self.input_scale = _parameter((parts,), torch.float32, device)

    def quantize_(self, quant: Fp8Scheme, input_scale: float) -> None:
        """Replace the high-precision weight by its FP8 form (tensorwise: with ``input_scale``)."""
        weight, scale = quantize_weight(self.weight, quant.granularity)
        self.quant = quant
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        if quant.granularity == "tensorwise":
            self.input_scale = nn.Parameter(torch.tensor(input_scale, device=weight.device), requires_grad=False)

    def fuse_scales_(self, part_rows: Sequence[int]) -> None:
        """After loading a tensorwise checkpoint: one weight and one input scale for the fused parts."""
        if self.quant is None or self.quant.granularity != "tensorwise":
            return
        weight, scale = requantize_parts(self.weight, self.weight_scale, list(part_rows))
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        # q, k and v read the same activations: the largest calibrated scale keeps them all in range.
        self.input_scale = nn.Parameter(self.input_scale.max(), requires_grad=False)

    def _scale_plans(self, names: Sequence[str], full_rows: Sequence[int], shard_rows: bool) -> list[ParamPlan]:
        """Plans of the checkpoint's ``weight_scale`` (and tensorwise ``input_scale``) tensors."""
        if self.quant is None:
            return []
        if self.quant.granularity == "rowwise":
            scales = tuple(
                _shard_slice(f"{name}.weight_scale", (n, 1), 0, self.tp) if shard_rows
                else TensorSlice(f"{name}.weight_scale", (n, 1))
                for name, n in zip(names, full_rows)
            )
            return [ParamPlan("weight_scale", scales)]
        # One value per part, [1] here; a checkpoint that stores it as a 0-d scalar reads as [1] too.
        return [
            ParamPlan(param, tuple(TensorSlice(f"{name}.{param}", (1,)) for name in names))
            for param in ("weight_scale", "input_scale")
        ]



class ColumnParallelLinear(_Linear):
    """``y = x @ W.T (+ b)`` with ``W``'s output features split across ranks; no communication.

    Several logical projections can be fused into one matmul (QKV, gate_up, as vLLM does): each of
    ``output_sizes`` is sharded separately and this rank holds ``[part0_shard; part1_shard; ...]``,
    so the local output splits cleanly with :attr:`local_output_sizes`.

    Shapes: input ``[T, in_features]`` (replicated) -> output ``[T, sum(output_sizes) / tp]``.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        *,
        tp: TensorParallel,
        checkpoint_names: Sequence[str],
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quant: Fp8Scheme | None = None,
    ) -> None:
        """``checkpoint_names[i]`` is the HF module name (relative to the parent) of ``output_sizes[i]``;
        ``quant``: FP8 parameters in checkpoint layout (see :class:`_Linear`)."""
        super().__init__()
        if len(checkpoint_names) != len(output_sizes):
            raise ValueError(
                f"need one checkpoint name per output part, got {checkpoint_names} for {output_sizes}"
            )
        self.tp = tp
        self.in_features = in_features
        self.output_sizes = tuple(output_sizes)
        self.checkpoint_names = tuple(checkpoint_names)
        self.local_output_sizes = tuple(
            tp.shard(n, f"output features of {name}") for n, name in zip(output_sizes, checkpoint_names)
        )
        rows = sum(self.local_output_sizes)
        self._init_fp8(quant, rows, in_features, len(output_sizes), dtype, device)
        self.bias = _parameter((rows,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x)

    def checkpoint_plan(self, parent: str) -> list[ParamPlan]:
        """Slices of the HF ``{parent}.{name}.weight`` (and ``.bias``) tensors this rank holds."""
        plans = [
            ParamPlan(
                "weight",
                tuple(
                    _shard_slice(qualify(parent, f"{name}.weight"), (n, self.in_features), 0, self.tp)
                    for n, name in zip(self.output_sizes, self.checkpoint_names)
                ),
            )
        ]
        plans += self._scale_plans(
            [qualify(parent, name) for name in self.checkpoint_names], self.output_sizes, shard_rows=True
        )
        if self.bias is not None:
            plans.append(
                ParamPlan(
                    "bias",
                    tuple(
                        _shard_slice(qualify(parent, f"{name}.bias"), (n,), 0, self.tp)
                        for n, name in zip(self.output_sizes, self.checkpoint_names)
                    ),
                )
            )
        return plans

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes} (local {self.local_output_sizes}), tp={self.tp.size}"


class RowParallelLinear(_Linear):
    """``y = all_reduce(x_shard @ W_shard.T)`` with ``W``'s input features split across ranks.

    This is where tensor parallelism communicates: each rank holds a partial sum over its slice of
    the input features, and the all_reduce (the op sequence parallelism turns into a reduce_scatter)
    completes it.

    Shapes: input ``[T, in_features / tp]`` -> output ``[T, out_features]`` (replicated).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp: TensorParallel,
        checkpoint_name: str,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quant: Fp8Scheme | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.checkpoint_name = checkpoint_name
        local_in = tp.shard(in_features, f"input features of {checkpoint_name}")
        self._init_fp8(quant, out_features, local_in, 1, dtype, device)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._linear(x)
        if self.tp.size > 1:
            out = funcol.all_reduce(out, "sum", self.tp.group())
        return out

    def checkpoint_plan(self, parent: str) -> list[ParamPlan]:
        name = qualify(parent, f"{self.checkpoint_name}.weight")
        weight = ParamPlan("weight", (_shard_slice(name, (self.out_features, self.in_features), 1, self.tp),))
        # Per output channel: every rank holds all of a row-parallel layer's output channels, so all scales.
        return [weight, *self._scale_plans([qualify(parent, self.checkpoint_name)], [self.out_features], False)]

    def extra_repr(self) -> str:
        return f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, tp={self.tp.size}"


# --------------------------------------------------------------------------------------------------
# Vocabulary-parallel embedding and LM head
# --------------------------------------------------------------------------------------------------


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary rows split across ranks.

    Rank ``r`` holds rows ``[r * V/tp, (r+1) * V/tp)``. Ids outside that range look up row 0 and are
    zeroed afterwards, so after the all_reduce every rank has every token's embedding.
    A vocabulary that ``tp`` does not divide is refused (rather than padded) so that checkpoints
    map one-to-one onto shards.

    Shapes: ``input_ids [T]`` (int64) -> ``[T, hidden_size]`` (replicated).
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tp: TensorParallel,
        checkpoint_name: str,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.checkpoint_name = checkpoint_name
        local = tp.shard(vocab_size, "vocab_size")
        self.vocab_start, self.vocab_end = tp.rank * local, (tp.rank + 1) * local
        self.weight = _parameter((local, hidden_size), dtype, device)
        # The forward reads this rank's range from tensors, not Python ints: Dynamo makes buffers graph inputs
        # and ints constants, so the compiled graph holds nothing rank-specific and every rank of a launch can
        # use the one compile of it (piece_compilers._compile_turn).
        self.register_buffer("first_id", torch.tensor(self.vocab_start, device=device), persistent=False)
        self.register_buffer("end_id", torch.tensor(self.vocab_end, device=device), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.first_id) | (input_ids >= self.end_id)
        local_ids = (input_ids - self.first_id).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return funcol.all_reduce(out, "sum", self.tp.group())

    def checkpoint_plan(self, parent: str) -> list[ParamPlan]:
        name = qualify(parent, f"{self.checkpoint_name}.weight")
        return [ParamPlan("weight", (_shard_slice(name, (self.vocab_size, self.hidden_size), 0, self.tp),))]

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size} (local [{self.vocab_start}, {self.vocab_end})), hidden={self.hidden_size}"


def gather_last_dim(x: torch.Tensor, tp_size: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``[T, N/tp]`` on each rank -> ``[T, N]``, rank ``r``'s block at columns ``[r*N/tp, (r+1)*N/tp)``.

    An all_gather along dim 0 (``[tp*T, N/tp]``), then the rank blocks move to the last dim.
    """
    gathered = _all_gather_single(x, 0, group)
    return gathered.view(tp_size, *x.shape).transpose(0, 1).reshape(x.shape[0], -1)


class ParallelLMHead(nn.Module):
    """Output projection with the vocabulary split across ranks, gathered to full logits.

    Each rank computes logits for its vocabulary shard, ``[T, V/tp]``, and an all_gather along the
    last dim returns ``[T, V]`` on every rank. With ``tie_to`` the weight is the embedding's own
    parameter (same vocabulary rows on the same rank) and nothing is loaded for it.

    Shapes: ``[T, hidden_size]`` -> ``[T, vocab_size]``.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        tp: TensorParallel,
        checkpoint_name: str,
        tie_to: VocabParallelEmbedding | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.checkpoint_name = checkpoint_name
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight = _parameter((tp.shard(vocab_size, "vocab_size"), hidden_size), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        if self.tp.size > 1:
            # [T, V/tp] per rank -> [tp*T, V/tp] (all_gather along dim 0) -> [T, V]: the rank blocks move to
            # the vocab dim. Permuting here rather than passing gather_dim=1 keeps Dynamo out of torch 2.11's
            # _maybe_view_chunk_cat, which it refuses to trace ("marked as skipped").
            logits = gather_last_dim(logits, self.tp.size, self.tp.group())
        return logits

    def checkpoint_plan(self, parent: str) -> list[ParamPlan]:
        if self.tied:
            return []
        name = qualify(parent, f"{self.checkpoint_name}.weight")
        return [ParamPlan("weight", (_shard_slice(name, (self.vocab_size, self.hidden_size), 0, self.tp),))]

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, hidden={self.hidden_size}, tied={self.tied}, tp={self.tp.size}"


# --------------------------------------------------------------------------------------------------
# Norm, activation, rotary embedding
# --------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add that precedes it (vLLM's form).

    ``norm(x)`` returns the normed ``x``. ``norm(x, residual)`` first forms ``x + residual``, returns
    ``(normed, new_residual)``. With ``residual_inplace`` the sum is written into ``residual`` with
    ``add_`` (as vLLM's ``fused_add_rms_norm`` kernel does); this is the form whose in-place update
    crosses piece boundaries and must survive the sequence-parallel rewrite.

    Written plainly (float32 statistics, weight applied in the input dtype, as HF does) so the
    compiler's passes can pattern-match it. Shapes: ``[T, hidden]`` in and out.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        *,
        checkpoint_name: str,
        residual_inplace: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.checkpoint_name = checkpoint_name
        self.residual_inplace = residual_inplace
        self.weight = _parameter((hidden_size,), dtype, device)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            if self.residual_inplace:
                residual.add_(x)
                x = residual
            else:
                x = x + residual
                residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)

    def checkpoint_plan(self, parent: str) -> list[ParamPlan]:
        name = qualify(parent, f"{self.checkpoint_name}.weight")
        return [ParamPlan("weight", (TensorSlice(name, (self.hidden_size,), init="ones"),))]

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, residual_inplace={self.residual_inplace}"


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate: ``silu(gate) * up`` for ``x = [gate | up]``, ``[T, 2*I] -> [T, I]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3.1's frequency-dependent RoPE scaling (same maths as HF's ``rope_type="llama3"``)."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept, the band between
    # interpolated smoothly.
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(medium, smoothed, scaled)


ROPE_TYPES = ("default", "llama3")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in HF's ``rotate_half`` convention (halves, not interleaved pairs).

    ``cos``/``sin`` are computed on the fly from ``positions`` in float32 (no ``max_position`` cache:
    a 128k-position table would cost more memory than the rest of a small test model).

    Supported ``rope_scaling``: none / ``"default"`` and ``"llama3"``.
    """

    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        rope_scaling: dict | None = None,
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}"
            )
        # Float32 on CPU, as HF computes it, so every device and rank gets bit-identical frequencies.
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq*D]`` and ``k [T, Hk*D]`` by the angles of ``positions [T]``."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos, sin = emb.cos().to(q.dtype)[:, None, :], emb.sin().to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return (x * cos + rotated * sin).reshape(shape)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}"
