"""Tensor-parallel model zoo: the toy model and Llama-family presets / HF checkpoints.

``sp_lab.models.build(name_or_path, *, tp_rank, tp_size, num_layers, dtype, device, seed, **overrides)``
returns ``model(input_ids [T]) -> logits [T, vocab]`` with ``model.spec`` (:class:`ModelSpec`).
Hugging Face models loaded by transformers itself: :func:`register_hf_attention` (split them at attention),
:func:`from_pretrained_tp_plan` (sharded with transformers' own plan) and :class:`CausalLMLogits` (the call to
compile).
"""

from sp_lab.models.checkpoint import CheckpointError
from sp_lab.models.hf import CausalLMLogits, from_pretrained_tp_plan, register_hf_attention
from sp_lab.models.llama import DecoderConfig, LlamaForCausalLM, ModelSpec
from sp_lab.models.registry import available, build, resolve_config

__all__ = [
    "CausalLMLogits",
    "CheckpointError",
    "DecoderConfig",
    "LlamaForCausalLM",
    "ModelSpec",
    "available",
    "build",
    "from_pretrained_tp_plan",
    "register_hf_attention",
    "resolve_config",
]
