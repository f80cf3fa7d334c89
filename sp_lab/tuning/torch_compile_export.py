"""The torch.compile export: PyTorch's own micro-pipeline TP (AsyncTP in Inductor) with the token gate sp_lab tuned.

What makes Inductor fuse, read in torch 2.13's sources (the same in 2.11-2.14):

- ``torch._inductor.config._micro_pipeline_tp = True``: ``fx_passes/post_grad.py`` runs ``micro_pipeline_tp_pass``
  only then (here through ``torch.compile(options={"_micro_pipeline_tp": True})``, which sets it for one compile);
- symmetric memory on the TP group: ``fx_passes/micro_pipeline_tp.py`` (``fuse_all_gather_matmul``,
  ``fuse_matmul_reduce_scatter``) returns without fusing where ``is_symm_mem_enabled_for_group(group_name)`` is
  false, and that is true only after ``torch.distributed._symmetric_memory.enable_symm_mem_for_group(group_name)``
  (marked deprecated, "no need to call", yet still the only thing that registers the group), and where NCCL is
  unavailable (a CPU-only build);
- the SP collectives in the graph: an ``all_gather`` of the token shard before the column-parallel matmuls and a
  ``reduce_scatter`` after the row-parallel ones (torchtitan's ``SequenceParallel`` plan, or functional
  collectives written so). The pass fuses what it finds; it does not create SP.

The pass has no token gate: it fuses every match at every size. :func:`torch_compile_snippet` applies the tuned gate
with two compiled programs of the same model, picked per call by the whole batch's token count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sp_lab.tuning.policy import fusion_threshold

if TYPE_CHECKING:
    from sp_lab.config import LabConfig

__all__ = ["torch_compile_section", "torch_compile_snippet"]


def _min_tokens(config: LabConfig) -> int | None:
    """Whole-batch tokens from which the tuned config fuses (``None``: never; tp 1 has nothing to fuse)."""
    return fusion_threshold(config) if config.tp_size > 1 else None


def torch_compile_snippet(config: LabConfig, *, provenance: str = "") -> str:
    """Python to paste after the model is built and parallelised: ``compile_with_async_tp(model, group)`` returns a
    callable that runs the micro-pipeline-TP program from the tuned token count and a plain compile below it."""
    gate = _min_tokens(config)
    note = f"\n# Tuned by sp_lab: {provenance}." if provenance else ""
    return f'''# torch.compile with Inductor's micro-pipeline TP (AsyncTP), fused only from the token count sp_lab tuned.{note}
# Needs the SP collectives in the model's graph (all_gather of the token shard before the column-parallel matmuls,
# reduce_scatter after the row-parallel ones, e.g. torchtitan's SequenceParallel plan) and an NCCL TP group.
import warnings

import torch
import torch.distributed as dist
from torch.distributed import _symmetric_memory

ASYNC_TP_MIN_TOKENS = {gate!r}  # whole batch: the first input's size along TOKEN_DIM (None: never fuse)
TOKEN_DIM = {config.token_dim}


def compile_with_async_tp(model, group=None):
    """Two compiled programs of ``model``: fused (micro-pipeline TP) from ASYNC_TP_MIN_TOKENS tokens, plain below."""
    group = dist.group.WORLD if group is None else group
    enable = getattr(_symmetric_memory, "enable_symm_mem_for_group", None)
    if enable is not None:  # marked deprecated, but without it Inductor's pass silently fuses nothing (torch 2.11-2.14)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group.group_name)
    fused = torch.compile(model, options={{"_micro_pipeline_tp": True}})
    plain = torch.compile(model)

    def run(*args, **kwargs):
        tokens = args[0].shape[TOKEN_DIM]
        use_fused = ASYNC_TP_MIN_TOKENS is not None and tokens >= ASYNC_TP_MIN_TOKENS
        return (fused if use_fused else plain)(*args, **kwargs)

    return run
'''


def torch_compile_section(config: LabConfig, *, provenance: str = "") -> dict[str, Any]:
    """The exported file's ``torch_compile`` section (torchtitan, plain PyTorch): the settings that make Inductor's
    micro-pipeline TP fire, how the tuned gate is applied, and the snippet that does both."""
    gate = _min_tokens(config)
    return {
        "micro_pipeline_tp": {
            "inductor_config": {"_micro_pipeline_tp": True},
            "symmetric_memory": "torch.distributed._symmetric_memory.enable_symm_mem_for_group(group.group_name) on "
                                "the TP group, before the first compiled call: deprecated in torch 2.11-2.14 but "
                                "still required (without it the pass fuses nothing, silently)",
            "needs": "the SP collectives in the graph (e.g. torchtitan's SequenceParallel plan) and an NCCL group",
            "no_gate": "the pass fuses every matched all-gather -> matmul and matmul -> reduce-scatter at every token "
                       "count; the gate is two compiled programs picked by token count (snippet)",
        },
        "async_tp_min_tokens": gate,
        "units": "whole batch: the model input's size along token_dim",
        "snippet": torch_compile_snippet(config, provenance=provenance),
        "tuned_gate": "sp_lab.compile(model, sp_lab.LabConfig.from_json(PATH)): SP and AsyncTP only in the compile "
                      f"ranges from {config.sp_start} tokens{'' if config.heuristic is None else ', the rule per matmul'}"
                      if config.enable_sp else "sp_lab.compile(model, sp_lab.LabConfig.from_json(PATH)): plain TP",
    }
