"""Hugging Face transformers models under ``sp_lab.compile``: the attention they split at, and the call compiled.

transformers calls attention through a registry (``transformers.AttentionInterface``), by the
name in ``config._attn_implementation``. Its own implementations (``"sdpa"``, ``"eager"``) reach Dynamo's graph as
``scaled_dot_product_attention`` or as matmuls and a softmax, which are not ops ``LabConfig.splitting_ops`` can
name, so a transformers model compiled with ``compile_mode="piecewise"`` ends up in one piece. vLLM solves the same
problem by calling attention through one opaque custom op and splitting there; :func:`register_hf_attention` does
that for transformers: it registers an implementation named ``"sp_lab"`` that calls ``sp_lab::attention`` (the op in
sp_lab's default ``splitting_ops``), so the model splits at every attention layer::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=sp_lab.models.register_hf_attention())
    # or, for a model already loaded (transformers 5): model.set_attn_implementation(register_hf_attention())
    # or, sharded with transformers' own tensor-parallel plan:
    model = sp_lab.models.from_pretrained_tp_plan(path, attn_implementation=sp_lab.models.register_hf_attention())
    compiled = sp_lab.compile(sp_lab.models.CausalLMLogits(model), sp_lab.LabConfig(token_dim=1, ...))

Scope (checked at trace time, with a message): causal self-attention over one unpadded sequence, the prefill
shape sp_lab compiles -- batch 1, no ``attention_mask``, no KV cache (``use_cache=False``), no logit soft-capping,
and a sliding window (Mistral) only as long as the sequence fits in it, where it is plain causal attention.
transformers drops the caller's ``attention_mask`` for an attention name it has no mask function for (a padded
batch would silently attend to its padding), so a mask function is registered under the same name: it hands a
caller's padding mask through, and the attention refuses it; without one it hands ``None``.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from torch import nn

from sp_lab.models.attention import attention

__all__ = ["HF_ATTENTION", "CausalLMLogits", "from_pretrained_tp_plan", "hf_attention_forward", "register_hf_attention"]

HF_ATTENTION = "sp_lab"
"""The name :func:`register_hf_attention` registers, for ``attn_implementation=``."""


def register_hf_attention() -> str:
    """Register :func:`hf_attention_forward` with transformers as ``"sp_lab"`` and return that name.

    Idempotent. Call it in every process that loads the model (inside the function ``sp_lab.launch`` runs).
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        # Older transformers build the causal mask inside the model for any attention name but "sdpa" / flash, so
        # this attention would receive a mask on every call and refuse it.
        raise ImportError(
            "register_hf_attention needs transformers' AttentionInterface and masking_utils.AttentionMaskInterface "
            "(transformers 5 has both; sp_lab is tested with 5.24): pip install -U transformers"
        ) from e
    AttentionInterface.register(HF_ATTENTION, hf_attention_forward)
    AttentionMaskInterface.register(HF_ATTENTION, _padding_mask_only)
    return HF_ATTENTION


def _padding_mask_only(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask hook: no causal mask to build (the op is causal); the caller's padding mask, if any."""
    return attention_mask


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature on ``sp_lab::attention``.

    ``query [1, H, T, D]``, ``key`` / ``value [1, Hkv, T, D]`` (this rank's heads, RoPE applied) ->
    ``([1, T, H, D], None)``, the layout transformers' ``o_proj`` reads.
    """
    batch, heads, tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    unsupported = {
        "batch": batch != 1,
        "attention_mask": attention_mask is not None,
        "KV cache (key longer than the queries)": key.shape[2] != tokens,
        "dropout": dropout != 0.0,
        "non-causal attention": is_causal is False or not getattr(module, "is_causal", True),
        # Within the window, sliding-window attention is causal attention. On a symbolic token count this check is
        # a Dynamo guard: a longer sequence is traced again and lands here.
        "a sequence longer than the sliding window": (
            (window := kwargs.get("sliding_window")) is not None and tokens > window),
        "softcap": kwargs.get("softcap") is not None,
        "value head size != query head size": value.shape[-1] != head_dim,
    }
    found = [what for what, bad in unsupported.items() if bad]
    if found:
        raise ValueError(
            f"attn_implementation={HF_ATTENTION!r} got {', '.join(found)} (query {tuple(query.shape)}, key "
            f"{tuple(key.shape)}): sp_lab's attention is causal over one unpadded sequence. Call the model with "
            "input_ids of shape [1, T], no attention_mask and use_cache=False, or use attn_implementation='sdpa' "
            "(which compiles as one piece)"
        )
    # [1, H, T, D] -> [T, H*D]: sp_lab's flattened layout. The output [T, H*D] is already [1, T, H, D] in memory.
    q = query.transpose(1, 2).reshape(tokens, heads * head_dim)
    k = key.transpose(1, 2).reshape(tokens, kv_heads * head_dim)
    v = value.transpose(1, 2).reshape(tokens, kv_heads * head_dim)
    scale = scaling if scaling is not None else head_dim**-0.5
    return attention(q, k, v, heads, kv_heads, scale).view(1, tokens, heads, head_dim), None


class CausalLMLogits(nn.Module):
    """``input_ids [1, T] -> logits [1, T, vocab]`` of a transformers causal LM, without a KV cache.

    The prefill call sp_lab compiles (``LabConfig(token_dim=1)``): a transformers model's own forward takes
    keyword options and returns a ``ModelOutput``; this is the one tensor-in, tensor-out call of it.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def from_pretrained_tp_plan(path: str | os.PathLike, **kwargs: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", **kwargs)`` on every rank of the process group.

    transformers shards the checkpoint with the model's own tensor-parallel plan (parameters become DTensors).
    Spelled as the installed transformers takes it: ``distributed_config=DistributedConfig(tp_plan="auto")`` where
    that exists (transformers 5 deprecates the ``tp_plan=`` keyword), ``tp_plan="auto"`` before. transformers
    refuses either without ``accelerate`` (in sp_lab's ``hf`` extra).
    """
    import transformers

    distributed_config = getattr(transformers, "DistributedConfig", None)
    if distributed_config is not None and "tp_plan" in inspect.signature(distributed_config).parameters:
        kwargs["distributed_config"] = distributed_config(tp_plan="auto")
    else:
        kwargs["tp_plan"] = "auto"
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
