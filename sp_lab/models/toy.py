"""The toy model: a tiny Llama-shaped decoder that compiles in seconds on CPU.

It has every feature the compiler passes must handle (vocab-parallel embedding, GQA attention with
RoPE, fused add+norm in both residual forms, SwiGLU MLP, gathered logits) at sizes where a 2-rank
gloo run and an Inductor compile stay fast. Any :class:`~sp_lab.models.llama.DecoderConfig` field can
be overridden, e.g. ``build("toy", residual_inplace=True, hidden_size=128)``.
"""

from __future__ import annotations

import dataclasses

from sp_lab.models.llama import DecoderConfig

__all__ = ["TOY", "toy_config"]

TOY = DecoderConfig(
    name="toy",
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,  # head_dim 16; 4 query heads and 2 KV heads shard evenly over tp = 1 or 2
    num_kv_heads=2,
    vocab_size=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    source="sp_lab built-in toy",
)
"""Default toy shapes: hidden 64, 4 heads (2 KV), MLP 128, vocab 256, 2 layers."""


def toy_config(**overrides) -> DecoderConfig:
    """The toy config with ``overrides`` applied (re-validated)."""
    return dataclasses.replace(TOY, **overrides)
