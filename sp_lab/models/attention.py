"""The attention op the piecewise compiler splits at: ``torch.ops.sp_lab.attention``.

Attention is registered as an opaque custom op (as vLLM's ``unified_attention`` is) so that Dynamo
keeps it as one node in the captured graph. The piecewise backend splits the graph at that node
(``LabConfig.splitting_ops == ["sp_lab::attention"]``), compiles the pieces in between and runs the
op eagerly between them.

Layout is vLLM's flattened one: one causal sequence of ``T`` tokens, heads folded into the last dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attention"]


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
        ``[T, num_heads * head_dim]``, token ``t`` attending to tokens ``0..t``.
    """
    num_tokens = q.shape[0]
    head_dim = q.shape[-1] // num_heads
    # [T, H*D] -> [H, T, D], the layout scaled_dot_product_attention expects.
    q = q.view(num_tokens, num_heads, head_dim).transpose(0, 1)
    k = k.view(num_tokens, num_kv_heads, head_dim).transpose(0, 1)
    v = v.view(num_tokens, num_kv_heads, head_dim).transpose(0, 1)
    if num_kv_heads != num_heads:
        # GQA: query head h reads KV head h // (num_heads // num_kv_heads), as in HF's repeat_kv.
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=0)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(0, 1).reshape(num_tokens, num_heads * head_dim)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int, scale: float):
    # Output has the query's shape; also serves device="meta" tracing.
    return torch.empty_like(q, memory_format=torch.contiguous_format)
