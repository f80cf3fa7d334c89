"""The attention op the piecewise compiler splits at: ``torch.ops.sp_lab.attention``.

Attention is registered as an opaque op (as vLLM's ``unified_attention`` is) so that Dynamo keeps it as
one node in the captured graph. The piecewise backend splits the graph at that node
(``LabConfig.splitting_ops == ["sp_lab::attention"]``), compiles the pieces in between and runs the
op eagerly between them.

Layout is vLLM's flattened one: one causal sequence of ``T`` tokens, heads folded into the last dim.

Kernels. ``scaled_dot_product_attention`` picks its fused backends only for 4-D ``[batch, heads, T,
head_dim]`` inputs; 3-D ones get the math backend, which materialises the ``T x T`` scores (22-58x slower
than flash on an H200 at 1024-8192 tokens, plus gigabytes). So the op views its inputs as
``[1, heads, T, head_dim]`` (a view, no copy) and lets the kernel read each KV head for its whole query
group (GQA) without repeating K/V, whenever a fused kernel accepts that (:func:`attention_kernel`):

- ``"flash"`` below :data:`FLASH_BELOW_TOKENS` tokens: FlashAttention directly. SDPA's own choice on an
  H200 (torch 2.11) is cuDNN's kernel, which costs 7.5 us against flash's 6.0 us at 2-64 tokens;
- ``"sdpa+gqa"`` from there on: SDPA with ``enable_gqa=True``, which picks cuDNN on an H200 (half flash's
  time at 1024-16384 tokens, 0.5-0.6x);
- ``"sdpa+repeat_kv"`` where no fused kernel takes GQA (the CPU, fp32 on CUDA: memory-efficient kernel);
- ``"sdpa"`` without GQA.

The op is defined with ``torch.library.Library`` rather than ``torch.library.custom_op``: it runs eagerly
between compiled pieces at every layer, and custom_op's Python wrapper cost ~20 us a call there (measured
on the H200 host, 69 vs 47 us per eager call at 1-64 tokens). sp_lab is inference-only: no autograd formula.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["FLASH_BELOW_TOKENS", "attention", "attention_kernel"]

FLASH_BELOW_TOKENS = 128
"""Below this many tokens the op calls FlashAttention itself instead of SDPA's choice (see the module doc)."""

_LIB = torch.library.Library("sp_lab", "FRAGMENT")
_LIB.define("attention(Tensor q, Tensor k, Tensor v, int num_heads, int num_kv_heads, float scale) -> Tensor")


@functools.cache
def _fused_gqa(device: torch.device, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int) -> tuple[bool, bool]:
    """``(flash takes these shapes with GQA, some fused SDPA kernel does)``, asked once per shape family.

    SDPA's own checks (``can_use_*_attention``) answer, so this follows the torch build and GPU.
    """
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    probe = [torch.empty((1, h, 2, head_dim), device=device, dtype=dtype) for h in (heads, kv_heads, kv_heads)]
    params = SDPAParams(*probe, None, 0.0, True, True)  # attn_mask, dropout, is_causal, enable_gqa
    flash = can_use_flash_attention(params, False)
    return flash, flash or can_use_efficient_attention(params, False)


def _kernel(device: torch.device, dtype: torch.dtype, num_tokens: int, head_dim: int, heads: int, kv_heads: int) -> str:
    if device.type != "cuda":
        return "sdpa" if heads == kv_heads else "sdpa+repeat_kv"
    flash, fused_gqa = _fused_gqa(device, dtype, head_dim, heads, kv_heads)
    if flash and num_tokens < FLASH_BELOW_TOKENS:
        return "flash"
    if heads == kv_heads:
        return "sdpa"
    return "sdpa+gqa" if fused_gqa else "sdpa+repeat_kv"


def attention_kernel(q: torch.Tensor, num_heads: int, num_kv_heads: int) -> str:
    """Which kernel path :func:`attention` takes for queries ``q`` ``[T, num_heads * head_dim]``:
    ``"flash"``, ``"sdpa+gqa"``, ``"sdpa+repeat_kv"`` or ``"sdpa"`` (see the module docstring)."""
    return _kernel(q.device, q.dtype, q.shape[0], q.shape[-1] // num_heads, num_heads, num_kv_heads)


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int, scale: float
) -> torch.Tensor:
    num_tokens = q.shape[0]
    head_dim = q.shape[-1] // num_heads
    kernel = _kernel(q.device, q.dtype, num_tokens, head_dim, num_heads, num_kv_heads)
    # [T, H*D] -> [1, H, T, D]: views for the layouts the model produces (q/k/v are column slices of one
    # projection, last dim unit-stride, which is what the fused kernels need); reshape copies otherwise.
    q = q.reshape(1, num_tokens, num_heads, head_dim).transpose(1, 2)
    k = k.reshape(1, num_tokens, num_kv_heads, head_dim).transpose(1, 2)
    v = v.reshape(1, num_tokens, num_kv_heads, head_dim).transpose(1, 2)
    if kernel == "flash":
        # FlashAttention reads KV head h // (num_heads // num_kv_heads) for query head h natively.
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]
    else:
        if kernel == "sdpa+repeat_kv":
            # Query head h reads KV head h // (num_heads // num_kv_heads), as in HF's repeat_kv.
            k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
            v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=kernel == "sdpa+gqa")
    # The fused kernels return [1, H, T, D] as a transposed view of a [1, T, H, D] buffer, so this reshape
    # is free there; the math path copies.
    return out.transpose(1, 2).reshape(num_tokens, num_heads * head_dim)


_LIB.impl("attention", _attention, "CompositeExplicitAutograd")


@torch.library.register_fake("sp_lab::attention", lib=_LIB)
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int, scale: float):
    # Output has the query's shape, contiguous (as the real kernels return it); also serves "meta" tracing.
    return torch.empty_like(q, memory_format=torch.contiguous_format)


attention = torch.ops.sp_lab.attention
"""``attention(q [T, H*D], k [T, Hkv*D], v [T, Hkv*D], num_heads, num_kv_heads, scale) -> [T, H*D]``:
causal attention over one sequence, query head ``h`` reading KV head ``h // (num_heads // num_kv_heads)``
(q and k with RoPE already applied; this rank's heads). Returns a contiguous tensor."""
