"""Tensor-parallel model zoo: the toy model and Llama-family presets / HF checkpoints.

``sp_lab.models.build(name_or_path, *, tp_rank, tp_size, num_layers, dtype, device, seed, **overrides)``
returns ``model(input_ids [T]) -> logits [T, vocab]`` with ``model.spec`` (:class:`ModelSpec`).
"""

from sp_lab.models.checkpoint import CheckpointError
from sp_lab.models.llama import DecoderConfig, LlamaForCausalLM, ModelSpec
from sp_lab.models.registry import available, build, resolve_config

__all__ = [
    "CheckpointError",
    "DecoderConfig",
    "LlamaForCausalLM",
    "ModelSpec",
    "available",
    "build",
    "resolve_config",
]
