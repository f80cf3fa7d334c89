"""The attention op the piecewise compiler splits at: ``torch.ops.sp_lab.attention``.

Attention is registered as an opaque custom op (as vLLM's ``unified_attention`` is) so that Dynamo
keeps it as one node in the captured graph. The piecewise backend splits the graph at that node
(``LabConfig.splitting_ops == ["sp_lab::attention"]``), compiles the pieces in between and runs the
op eagerly between them.

Layout is vLLM's flattened one: one causal sequence of ``T`` tokens, heads folded into the last dim.

Kernels: ``scaled_dot_product_attention`` only picks its fused backends (flash, memory-efficient) for
4-D ``[batch, heads, T, head_dim]`` inputs; 3-D ones get the math backend, which materialises the
``T x T`` score matrix (22-58x slower than flash on an H200 at 1024-8192 tokens, and gigabytes of
memory). So the op views its inputs as ``[1, heads, T, head_dim]`` (a view, no copy) and, for GQA,
lets the kernel read each KV head for its whole query group (``enable_gqa=True``) whenever SDPA's own
checks say a fused kernel accepts that; only otherwise (e.g. fp32 on CUDA, served by the
memory-efficient kernel, which has no GQA) are K/V repeated per query head.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["attention", "sdpa_kernel_for"]


@functools.cache
def _fused_kernel_takes_gqa(device: torch.device, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int) -> str:
    """Which fused SDPA kernel accepts these GQA shapes unrepeated: "flash", "efficient" or "" (none).

    Asked once per shape family with SDPA's own checks (``can_use_*_attention``), so the answer follows
    whatever this torch build and GPU support instead of a hand-kept table.
    """
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    probe = [torch.empty((1, h, 2, head_dim), device=device, dtype=dtype) for h in (heads, kv_heads, kv_heads)]
    params = SDPAParams(*probe, None, 0.0, True, True)  # attn_mask, dropout, is_causal, enable_gqa
    if can_use_flash_attention(params, False):
        return "flash"
    if can_use_efficient_attention(params, False):
        return "efficient"
    return ""


def sdpa_kernel_for(q: torch.Tensor, num_heads: int, num_kv_heads: int) -> str:
    """How :func:`attention` calls SDPA for queries like ``q`` ``[T, num_heads * head_dim]``.

    ``"gqa:flash"`` / ``"gqa:efficient"`` when that fused kernel reads the shared KV heads directly,
    ``"repeat_kv"`` when K/V are repeated per query head first (CPU, or no fused kernel takes GQA for
    this dtype and head size), ``"mha"`` without GQA. The op itself asks the same question.
    """
    return _gqa_mode(q.device, q.dtype, q.shape[-1] // num_heads, num_heads, num_kv_heads)


def _gqa_mode(device: torch.device, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int) -> str:
    if kv_heads == heads:
        return "mha"
    if device.type != "cuda":
        return "repeat_kv"
    kernel = _fused_kernel_takes_gqa(device, dtype, head_dim, heads, kv_heads)
    return f"gqa:{kernel}" if kernel else "repeat_kv"


@torch.library.custom_op("sp_lab::attention", mutates_args=())
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int, scale: float
) -> torch.Tensor:
    """Causal multi-head attention with grouped-query KV heads over one sequence.

    Args:
        q: ``[T, num_heads * head_dim]`` queries (this rank's heads, RoPE already applied).
        k: ``[T, num_kv_heads * head_dim]`` keys (RoPE already applied).
        v: ``[T, num_kv_heads * head_dim]`` values.
        num_heads: query heads held by this rank.
        num_kv_heads: KV heads held by this rank; must divide ``num_heads``.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Returns:
        ``[T, num_heads * head_dim]`` (contiguous), token ``t`` attending to tokens ``0..t``.
    """
    num_tokens = q.shape[0]
    head_dim = q.shape[-1] // num_heads
    # [T, H*D] -> [1, H, T, D]: views for the layouts the model produces (q/k/v are column slices of one
    # projection, last dim unit-stride, which is what the fused kernels need); reshape copies otherwise.
    q = q.reshape(1, num_tokens, num_heads, head_dim).transpose(1, 2)
    k = k.reshape(1, num_tokens, num_kv_heads, head_dim).transpose(1, 2)
    v = v.reshape(1, num_tokens, num_kv_heads, head_dim).transpose(1, 2)
    gqa = _gqa_mode(q.device, q.dtype, head_dim, num_heads, num_kv_heads)
    if gqa == "repeat_kv":
        # Query head h reads KV head h // (num_heads // num_kv_heads), as in HF's repeat_kv.
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa.startswith("gqa"))
    # The fused kernels return [1, H, T, D] as a transposed view of a [1, T, H, D] buffer, so this reshape
    # is free there; the math path copies.
    return out.transpose(1, 2).reshape(num_tokens, num_heads * head_dim)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int, scale: float):
    # Output has the query's shape; also serves device="meta" tracing.
    return torch.empty_like(q, memory_format=torch.contiguous_format)
