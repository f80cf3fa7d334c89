"""vLLM's ``--compilation-config`` field names, per release, as read from vLLM's own source.

vLLM's ``CompilationConfig`` and ``PassConfig`` are pydantic dataclasses that reject unknown fields, and
the fields SP and AsyncTP need were renamed between releases. :meth:`sp_lab.config.LabConfig.to_vllm`
therefore writes only names listed here for the release asked for, and a test checks every exported
object against these lists. Each entry records the file and the snapshot it was read from; only fields a
user can pass (``init=True``) are listed.

How SP is made to run differs per release (what ``to_vllm`` relies on, from the same files):

- ``"0.11"``: ``pass_config.enable_sequence_parallelism`` / ``enable_async_tp``; no token threshold and no
  compile ranges: the SP pass applies to static compile sizes divisible by tp only, so the threshold is
  expressed as ``compile_sizes`` (capture sizes and powers of two from it on that tp divides).
- ``"0.12"``: renamed to ``enable_sp`` / ``fuse_gemm_comms``; ``compile_ranges_split_points`` exists, but
  no SP token threshold yet, so again ``compile_sizes`` carry it; the split point separates the ranges.
- ``"2026.03"``: ``pass_config.sp_min_token_num`` gates SP by token count, and the compile ranges are
  ``compile_ranges_endpoints`` (the renamed ``compile_ranges_split_points``).

In every release SP and AsyncTP need the whole graph in one piece (``splitting_ops: []``), because the
pass skips a piece that is not the whole layer stack.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sp_lab.config import LabConfig


@dataclasses.dataclass(frozen=True)
class VllmRelease:
    """The ``--compilation-config`` fields one vLLM release accepts, and where they were read."""

    name: str
    """The name ``LabConfig.to_vllm(version=...)`` takes."""
    source: str
    """File, repository snapshot and the evidence for the release it belongs to."""
    compilation_fields: frozenset[str]
    """``CompilationConfig`` fields a user may set."""
    pass_fields: frozenset[str]
    """``PassConfig`` fields a user may set."""
    sp_flag: str
    """The ``PassConfig`` field that turns SP on."""
    async_tp_flag: str
    """The ``PassConfig`` field that turns AsyncTP (GEMM + collective fusion) on."""
    mode_field: str
    """``"level"`` or ``"mode"``: how the release names "compile with vLLM's backend" (value 3)."""
    sp_threshold_field: str | None
    """``PassConfig`` field gating SP by token count, or ``None`` (the threshold goes into compile sizes)."""
    ranges_field: str | None
    """``CompilationConfig`` field that splits compile ranges, or ``None``."""


_COMMON_COMPILATION = frozenset({
    "mode", "debug_dump_path", "cache_dir", "compile_cache_save_format", "backend", "custom_ops",
    "splitting_ops", "compile_mm_encoder", "compile_sizes", "inductor_compile_config", "inductor_passes",
    "cudagraph_mode", "cudagraph_num_of_warmups", "cudagraph_capture_sizes", "cudagraph_copy_inputs",
    "cudagraph_specialize_lora", "use_inductor_graph_partition", "pass_config", "max_cudagraph_capture_size",
})

RELEASES: dict[str, VllmRelease] = {
    r.name: r
    for r in (
        VllmRelease(
            name="0.11",
            source="vllm/config/compilation.py of the 0.11 release line (its notes deprecate `level` for "
            "'0.12.0 or 0.11.2' and `use_inductor` for 'v0.12.0'); PassConfig still spells "
            "enable_sequence_parallelism / enable_async_tp",
            compilation_fields=_COMMON_COMPILATION
            | {"level", "use_inductor", "use_cudagraph", "full_cuda_graph"},
            pass_fields=frozenset({
                "enable_fusion", "enable_attn_fusion", "enable_noop", "enable_sequence_parallelism",
                "enable_async_tp", "enable_fi_allreduce_fusion", "fi_allreduce_fusion_max_size_mb",
                "enable_qk_norm_rope_fusion",
            }),
            sp_flag="enable_sequence_parallelism",
            async_tp_flag="enable_async_tp",
            mode_field="level",  # a field in 0.11.0, an accepted deprecated alias of `mode` in 0.11.1
            sp_threshold_field=None,
            ranges_field=None,
        ),
        VllmRelease(
            name="0.12",
            source="vllm/config/compilation.py at vllm-project/vllm@002284db4c87 (PassConfig with the "
            "renamed enable_sp / fuse_gemm_comms, as the 0.12.0 docs' optimization levels spell them; "
            "compile_ranges_split_points present; no sp_min_token_num)",
            compilation_fields=_COMMON_COMPILATION
            | {"level", "compile_ranges_split_points", "dynamic_shapes_config"},
            pass_fields=frozenset({
                "fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant", "eliminate_noops", "enable_sp",
                "fuse_gemm_comms", "fuse_allreduce_rms", "fi_allreduce_fusion_max_size_mb",
                "enable_qk_norm_rope_fusion",
            }),
            sp_flag="enable_sp",
            async_tp_flag="fuse_gemm_comms",
            mode_field="mode",
            sp_threshold_field=None,
            ranges_field="compile_ranges_split_points",
        ),
        VllmRelease(
            name="2026.03",
            source="vllm/config/compilation.py after compile_ranges_split_points was renamed "
            "compile_ranges_endpoints (March 2026; tlparse PR #175 follows the rename), read from a "
            "public copy of the file; PassConfig has sp_min_token_num, `level` is gone",
            compilation_fields=_COMMON_COMPILATION
            | {"compile_ranges_endpoints", "dynamic_shapes_config"},
            pass_fields=frozenset({
                "fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant", "eliminate_noops", "enable_sp",
                "fuse_gemm_comms", "fuse_allreduce_rms", "enable_qk_norm_rope_fusion", "fuse_act_padding",
                "fuse_rope_kvcache", "rope_kvcache_fusion_max_token_num", "fi_allreduce_fusion_max_size_mb",
                "sp_min_token_num",
            }),
            sp_flag="enable_sp",
            async_tp_flag="fuse_gemm_comms",
            mode_field="mode",
            sp_threshold_field="sp_min_token_num",
            ranges_field="compile_ranges_endpoints",
        ),
    )
}
"""Every release ``to_vllm`` can write for, by name."""

DEFAULT_RELEASE = "2026.03"
"""The release an exported file's ``vllm`` section targets unless told otherwise."""

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
"""vLLM's ``CUDAGraphMode`` names (the same in all three releases)."""


def release(name: str) -> VllmRelease:
    """The release called ``name``; an unknown name is an error listing the known ones."""
    if name not in RELEASES:
        raise KeyError(
            f"unknown vLLM release {name!r}; known: {', '.join(RELEASES)} (field lists vendored in "
            "sp_lab/vllm_releases.py)"
        )
    return RELEASES[name]


def unknown_fields(compilation_config: dict, name: str) -> list[str]:
    """Keys of a ``--compilation-config`` object (and its ``pass_config``) that release ``name`` rejects."""
    rel = release(name)
    bad = [k for k in compilation_config if k not in rel.compilation_fields]
    bad += [f"pass_config.{k}" for k in compilation_config.get("pass_config", {}) if k not in rel.pass_fields]
    return bad


class NotExpressible(ValueError):
    """A config vLLM cannot run as sp_lab does (the message says why and what to do)."""


def compilation_config(config: LabConfig, name: str) -> dict[str, Any]:
    """``config`` as a ``--compilation-config`` object for release ``name`` (see ``LabConfig.to_vllm``).

    Raises ``KeyError`` for an unknown release and :class:`NotExpressible` for a policy vLLM cannot run.
    """
    rel = release(name)
    sp = config.enable_sp and config.tp_size > 1
    fused = sp and config.enable_async_tp
    if fused and config.sp_start < config.async_tp_min_tokens:
        raise NotExpressible(
            f"SP starts at {config.sp_start} tokens and AsyncTP at {config.async_tp_min_tokens}, but vLLM "
            f"{name} fuses GEMMs with collectives wherever SP runs (one gate for both); export a "
            "single-threshold policy (sp_min_tokens=None) or keep this config to sp_lab"
        )
    out: dict[str, Any] = {rel.mode_field: 3, "pass_config": {rel.sp_flag: sp, rel.async_tp_flag: fused}}
    # LabConfig.cudagraph_mode ("none", "piecewise", "full", "full_and_piecewise") names vLLM's CUDAGraphMode
    graphs = getattr(config, "cudagraph_mode", None)
    if not sp:
        if graphs not in (None, "none"):
            out["cudagraph_mode"] = graphs.upper()
        return out
    start = config.sp_start
    out["splitting_ops"] = []
    # Piece-wise CUDA graphs would need piece boundaries: full graphs for every batch where sp_lab measured
    # its "full" mode, else for decode batches.
    out["cudagraph_mode"] = "FULL" if graphs == "full" else "FULL_DECODE_ONLY"
    if rel.sp_threshold_field is not None:
        out["pass_config"][rel.sp_threshold_field] = start
    else:
        # The SP pass of these releases runs only on static compile sizes that tp divides: the capture
        # sizes (padded decode batches) and powers of two up to max_num_tokens (full prefill chunks).
        top = config.max_num_tokens
        ladder = {*config.resolved_capture_sizes(), top, *(2**k for k in range(top.bit_length()) if 2**k <= top)}
        sizes = sorted(s for s in ladder if s >= start and s % config.tp_size == 0)
        if not sizes:
            raise NotExpressible(
                f"vLLM {name} runs SP only at static compile sizes that tp={config.tp_size} divides, and none "
                f"from {start} to max_num_tokens={top} is; raise max_num_tokens or add cudagraph_capture_sizes "
                "that tp divides"
            )
        out["compile_sizes"] = sizes
    if rel.ranges_field is not None and start > 1:
        out[rel.ranges_field] = [start - 1]  # vLLM's ranges are [1, p], [p + 1, ...]
    return out
