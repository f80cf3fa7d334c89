"""FP8 linear layers as vLLM runs them on Hopper: ``torch._scaled_mm`` on float8_e4m3fn operands, bf16 out.

Two schemes (both ``torch._scaled_mm`` scale layouts; PyTorch docs of ``_scaled_mm`` and vLLM's
``Fp8LinearMethod``):

- ``"rowwise"``: a weight scale per output channel (``weight_scale [out, 1]``) and a *dynamic* activation
  scale per token (``amax(|x_t|) / 448`` at run time). The public "FP8-dynamic" checkpoints use this.
- ``"tensorwise"``: one weight scale and one *static* activation scale (``input_scale``, calibrated
  offline and stored in the checkpoint), the "FP8" static checkpoints.

Both are token-local: a token's quantised row and its scale depend on that token alone (a dynamic
*per-tensor* scale would need every token's amax). So sequence parallelism can quantise on the token shard
and all-gather the 1-byte values with their scales (half the bytes of bf16), and the all_gather feeds the
scaled matmul directly, the pair AsyncTP fuses.

Checkpoints: the compressed-tensors "float-quantized" layout public FP8 Llama checkpoints use
(``weight`` float8_e4m3fn ``[out, in]``, ``weight_scale`` ``[out, 1]`` (channel) or one value (tensor), optional
``input_scale``; ``quantization_config.quant_method == "compressed-tensors"`` in config.json), read by
:func:`quant_from_hf`. Checkpoints in the wild store a tensorwise scale either as ``[1]`` or as a 0-d scalar;
both load (:meth:`~sp_lab.models.checkpoint.SafetensorsWeights.read` reads a 0-d tensor as ``[1]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "QUANT_SCHEMES",
    "RANDOM_INPUT_SCALE",
    "Fp8Scheme",
    "quant_from_hf",
    "quantize_rowwise",
    "quantize_static",
    "quantize_weight",
    "requantize_parts",
    "resolve_quant",
    "scaled_linear",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# A zero row (the SP pass pads token counts tp does not divide with zero rows) would give scale 0 and 0/0;
# vLLM clamps the per-token scale the same way.
_MIN_SCALE = 1e-12
RANDOM_INPUT_SCALE = 8.0 / FP8_MAX
"""Static activation scale of randomly initialised tensorwise layers: |x| up to 8 is representable, which
covers the O(1) activations of sp_lab's random models (a real checkpoint brings calibrated scales)."""

QUANT_SCHEMES = ("rowwise", "tensorwise")


@dataclass(frozen=True)
class Fp8Scheme:
    """How one FP8 model scales its matmuls."""

    granularity: Literal["rowwise", "tensorwise"] = "rowwise"
    """``rowwise``: per-channel weight, dynamic per-token activation scales; ``tensorwise``: one weight
    scale and a static activation scale per layer. ``_scaled_mm`` returns the model's dtype (bf16 as vLLM
    runs FP8; its fused FP8 collectives support bf16 output only)."""

    def __post_init__(self) -> None:
        if self.granularity not in QUANT_SCHEMES:
            raise ValueError(f"FP8 granularity {self.granularity!r} is not one of {QUANT_SCHEMES}")

    @property
    def name(self) -> str:
        """``"fp8-rowwise"`` / ``"fp8-tensorwise"``: the dtype label reports and tuning rows carry."""
        return f"fp8-{self.granularity}"


def resolve_quant(quant: str | Fp8Scheme | None) -> Fp8Scheme | None:
    """``build(quant=...)``'s argument as a scheme: ``None``, ``"fp8"`` (rowwise), ``"fp8-rowwise"``,
    ``"fp8-tensorwise"`` or an :class:`Fp8Scheme`."""
    if quant is None or isinstance(quant, Fp8Scheme):
        return quant
    names = {"fp8": "rowwise", "fp8-rowwise": "rowwise", "fp8-tensorwise": "tensorwise"}
    if quant not in names:
        raise ValueError(f"quant={quant!r} is not supported; use None, {sorted(names)} or an Fp8Scheme")
    return Fp8Scheme(names[quant])


def quantize_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantisation: ``x [T, K]`` -> ``(x_fp8 [T, K], scale [T, 1] float32)``,
    ``x ~= x_fp8 * scale`` row by row."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Quantisation with a calibrated scalar ``input_scale``: ``x [T, K]`` -> ``x_fp8 [T, K]``."""
    return (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def scaled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``x @ (weight * weight_scale).T + bias`` through ``torch._scaled_mm``.

    x: ``[..., K]`` (bf16/fp32); weight: ``[N, K]`` float8_e4m3fn (its ``.t()`` is the column-major
    ``[K, N]`` operand ``_scaled_mm`` wants); weight_scale: ``[N, 1]`` (rowwise) or ``[]``;
    input_scale: ``[]`` for a static scale, None for dynamic per-token scales. Returns ``[..., N]`` in
    ``out_dtype``.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if input_scale is None:
        x_fp8, x_scale = quantize_rowwise(x2)
        w_scale = weight_scale.reshape(1, -1)  # [1, N]: _scaled_mm's rowwise layout for mat2
    else:
        x_fp8, x_scale = quantize_static(x2, input_scale), input_scale
        w_scale = weight_scale
    out = torch._scaled_mm(x_fp8, weight.t(), x_scale, w_scale, bias=bias, out_dtype=out_dtype)
    return out.reshape(*lead, out.shape[-1])


def quantize_weight(weight: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A high-precision ``weight [N, K]`` -> ``(weight_fp8 [N, K], scale)``: ``scale [N, 1]`` per output
    channel (rowwise) or ``[]`` (tensorwise), float32, ``weight ~= weight_fp8 * scale``."""
    w = weight.float()
    amax = w.abs().amax(dim=-1, keepdim=True) if granularity == "rowwise" else w.abs().amax()
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def requantize_parts(weight: torch.Tensor, part_scales: torch.Tensor, part_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensorwise scale for a fused projection (q|k|v) whose parts came with a scale each:
    dequantise each part with its own scale and requantise all with the largest (vLLM does the same)."""
    # output_size: a meta tensor (build(device="meta")) has no values to sum the repeats from.
    rows = torch.repeat_interleave(part_scales.float().reshape(-1), torch.tensor(part_rows, device=weight.device),
                                   output_size=sum(part_rows))
    scale = part_scales.float().max()
    dequant = weight.float() * rows[:, None]
    return (dequant / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quant_from_hf(hf: dict[str, Any]) -> Fp8Scheme | None:
    """The scheme of a checkpoint's ``quantization_config`` (compressed-tensors float-quantized), or None.

    Reads the first config group's ``weights.strategy`` (``"channel"`` -> rowwise, ``"tensor"`` ->
    tensorwise) and ``input_activations.dynamic``; refuses what sp_lab does not run (other methods,
    block scales, static per-token activations) with the value and what would work.
    """
    q = hf.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"quantization_config.quant_method={method!r} is not supported; sp_lab reads FP8 checkpoints in the "
            "compressed-tensors float-quantized layout (quant_method 'compressed-tensors')"
        )
    groups = list((q.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("quantization_config has no config_groups; expected a compressed-tensors FP8 scheme")
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
    if weights.get("type", "float") != "float" or weights.get("num_bits", 8) != 8:
        raise ValueError(f"quantization_config weights {weights} are not FP8 (type 'float', num_bits 8)")
    strategy, dynamic = weights.get("strategy"), bool(acts.get("dynamic", False))
    if strategy == "channel" and dynamic:
        return Fp8Scheme("rowwise")
    if strategy == "tensor" and not dynamic:
        return Fp8Scheme("tensorwise")
    raise ValueError(
        f"FP8 weights strategy {strategy!r} with dynamic activations={dynamic} is not supported; sp_lab runs "
        "'channel' weights with dynamic per-token activations (rowwise) and 'tensor' weights with a static "
        "input_scale (tensorwise)"
    )
