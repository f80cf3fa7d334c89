"""``build()``: from a name ("toy", a preset) or a local HF checkpoint to a ready TP model.

Presets are Hugging Face ``config.json`` shape fields shipped in ``data/models/<name>.json``, each
with a ``_source`` naming the public config the numbers come from. Their weights are random
(:class:`~sp_lab.models.checkpoint.RandomWeights`); a checkpoint directory brings its own.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from sp_lab.models.checkpoint import (
    CheckpointError,
    RandomWeights,
    SafetensorsWeights,
    is_checkpoint_dir,
    load_weights,
    read_hf_config,
)
from sp_lab.models.fp8 import RANDOM_INPUT_SCALE, Fp8Scheme, resolve_quant
from sp_lab.models.layers import ColumnParallelLinear, RowParallelLinear, TensorParallel
from sp_lab.models.llama import DecoderConfig, LlamaForCausalLM
from sp_lab.models.toy import toy_config
from sp_lab.resources import PRESET_DIR, load_preset, preset_names

__all__ = ["MODEL_DTYPES", "PRESET_DIR", "CheckpointNotFoundError", "UnknownModelError", "available", "build",
           "resolve_config", "resolve_dtype"]

MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The parameter and activation dtypes a model is built in (``build(dtype=...)``), by name: those sp_lab's
timings, rules and predictions know (:data:`sp_lab.tuning.predict.kernels.DTYPE_BYTES`). FP8 is not one of
them: it is ``quant="fp8"`` on a bf16 model, as vLLM runs it (only the matmuls are FP8)."""


class UnknownModelError(ValueError):
    """A model name that is neither ``"toy"``, a preset nor a checkpoint directory; the message offers the closest."""


class CheckpointNotFoundError(UnknownModelError):
    """A checkpoint path (it has a ``/``) where nothing exists; the message gives the path resolved."""


def available() -> list[str]:
    """Names ``build`` accepts besides a checkpoint path: ``"toy"`` and every preset."""
    return ["toy", *preset_names()]


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``build(dtype=...)``'s argument as a torch dtype: one of :data:`MODEL_DTYPES`, as a ``torch.dtype`` or by
    name (``"bfloat16"``, ``"torch.bfloat16"``). Anything else is refused here, naming the value and the accepted
    ones, instead of failing inside ``torch.empty`` (a name) or at the first matmul (an integer dtype)."""
    if isinstance(dtype, torch.dtype) and dtype in MODEL_DTYPES.values():
        return dtype
    named = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if isinstance(named, torch.dtype) and named in MODEL_DTYPES.values():  # torch's names and aliases: "half"
        return named
    fp8 = " (for FP8 matmuls pass quant='fp8' with dtype='bfloat16')" if "float8" in str(dtype) else ""
    raise ValueError(f"dtype={dtype!r} is not a model dtype; use one of {list(MODEL_DTYPES)} (a name or the "
                     f"torch.dtype){fp8}")


def _is_preset(name: str) -> bool:
    return "/" not in name and (name == "toy" or (PRESET_DIR / f"{name}.json").is_file())


def _check_quant(name: str, stored: Fp8Scheme | None, wanted: Fp8Scheme | None) -> None:
    """An FP8 checkpoint is FP8 as stored: another scheme would need the high-precision weights it lacks."""
    if wanted is not None and stored is not None and wanted != stored:
        raise ValueError(
            f"{name} is an FP8 checkpoint ({stored.name}); quant={wanted.name!r} would need its "
            f"high-precision weights. Leave quant out (or pass quant={stored.name!r})"
        )


def resolve_config(name_or_path: str | Path, *, num_layers: int | None = None, **overrides) -> DecoderConfig:
    """The :class:`DecoderConfig` ``build`` would use, without building anything.

    A name is ``"toy"`` or a preset; anything with a ``/`` (``./llama-3-8b``) is a checkpoint directory. A bare
    name that is both a preset and a checkpoint directory here is refused: which one was meant cannot be told,
    and taking the preset would give the directory's user random weights without a word. A ``quant``
    override is resolved as ``build(quant=...)`` resolves it (:func:`~sp_lab.models.fp8.resolve_quant`).

    Raises ``ValueError`` for an unknown name or override, naming what would work.
    """
    unknown = sorted(set(overrides) - set(DecoderConfig.field_names()) - {"name"})
    if unknown:
        raise ValueError(
            f"unknown model override(s) {unknown}; accepted: {sorted(set(DecoderConfig.field_names()) - {'name'})}"
        )
    if num_layers is not None:
        overrides["num_layers"] = num_layers
    if "quant" in overrides:  # a typo ("fp9") is refused here, not in every rank of a launched sweep
        overrides["quant"] = resolve_quant(overrides["quant"])
    name = str(name_or_path)
    if _is_preset(name) and is_checkpoint_dir(name):
        raise ValueError(
            f"{name!r} is both a preset and a checkpoint directory here ({Path(name).resolve()}); say which: "
            f"'./{name}' (or its absolute path) for the checkpoint directory, or rename the directory (or run from "
            f"another working directory) for the preset"
        )
    if name == "toy":
        return toy_config(**overrides)
    if _is_preset(name):
        cfg = DecoderConfig.from_hf(load_preset(name), name=name)
    elif is_checkpoint_dir(name):
        cfg = DecoderConfig.from_hf(read_hf_config(name), name=name, source=str(Path(name).resolve()))
    elif Path(name).is_dir():
        raise CheckpointError(
            f"{name} is a directory without config.json; a Hugging Face checkpoint needs one"
        )
    elif not _is_preset(name) and "/" in name:  # meant as a path (a preset name has no "/")
        where = Path(name).resolve()
        found = "a file, not a directory" if where.exists() else "not found"
        tilde = " (~ is not expanded: give the full path)" if name.startswith("~") else ""
        raise CheckpointNotFoundError(
            f"checkpoint directory {name!r} {found}: {where}{tilde} (a relative path is taken from the working "
            f"directory, {Path.cwd()}); give the directory that holds config.json and *.safetensors, or one of "
            f"{available()}"
        )
    else:
        close = difflib.get_close_matches(name, available(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UnknownModelError(
            f"unknown model {name!r}: not a preset, and no checkpoint directory {Path(name).resolve()} was found; "
            f"{hint}use one of {available()} or a local Hugging Face checkpoint directory (config.json + "
            "*.safetensors)"
        )
    _check_quant(name, cfg.quant, overrides.get("quant"))
    return dataclasses.replace(cfg, **overrides)


def _check_process_group(tp: TensorParallel) -> None:
    # Collectives run on WORLD, so a TP model must span exactly the world it runs in.
    if tp.size > 1 and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != tp.size or rank != tp.rank:
            raise ValueError(
                f"tp_size={tp.size}, tp_rank={tp.rank} do not match the initialised process group "
                f"(world_size={world}, rank={rank}); pass tp_size=dist.get_world_size(), tp_rank=dist.get_rank()"
            )


def build(
    name_or_path: str | Path,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    num_layers: int | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    quant: str | Fp8Scheme | None = None,
    **overrides,
) -> nn.Module:
    """Build a tensor-parallel causal LM: ``model(input_ids [T]) -> logits [T, vocab_size]``.

    Args:
        name_or_path: ``"toy"``, a preset (``available()``: llama-2-7b, llama-3-8b, llama-3-70b,
            mistral-7b, qwen2.5-7b) or a local HF checkpoint directory (config.json + safetensors).
        tp_rank, tp_size: this rank's place in the TP group. With ``tp_size > 1`` the model must run
            inside an initialised process group of exactly ``tp_size`` ranks (it uses WORLD).
        num_layers: keep only this many decoder layers (the first ones for a checkpoint).
        dtype: parameter dtype, one of :data:`MODEL_DTYPES` (a ``torch.dtype`` or its name, ``"bfloat16"``);
            random weights are drawn in float32 and rounded to it.
        device: where parameters live. ``"meta"`` builds shapes only, with no initialisation and no
            file reads, for tracing e.g. an 80-layer 70B model under the fake process group.
        seed: random-weight seed; the same seed gives the same full model at every ``tp_size``.
        quant: ``"fp8"`` (= ``"fp8-rowwise"``: per-channel weight and dynamic per-token activation scales) or
            ``"fp8-tensorwise"`` (one weight scale, a static activation scale): the matmuls run through
            ``torch._scaled_mm`` with ``dtype`` (use bf16, as vLLM does) out. Random and high-precision
            checkpoint weights are quantised after loading; an FP8 checkpoint (compressed-tensors
            ``quantization_config``) is FP8 without it.
        **overrides: any :class:`DecoderConfig` field, e.g. ``residual_inplace=True``, ``hidden_size=128``.

    Returns:
        The model in eval mode, with ``model.spec`` (:class:`ModelSpec`), ``model.config`` and ``model.tp``.
    """
    dtype = resolve_dtype(dtype)
    cfg = resolve_config(name_or_path, num_layers=num_layers, **overrides)
    quant = resolve_quant(quant)
    _check_quant(str(name_or_path), cfg.quant, quant)
    tp = TensorParallel(rank=tp_rank, size=tp_size)
    cfg.check_tp_size(tp.size)
    _check_process_group(tp)
    stored = cfg  # what the weights are stored as: FP8 only for an FP8 checkpoint
    model = LlamaForCausalLM(stored, tp=tp, dtype=dtype, device=device)
    if torch.device(device).type != "meta":
        checkpoint = not _is_preset(str(name_or_path))  # resolve_config refused a name that is both
        load_weights(model, SafetensorsWeights(name_or_path) if checkpoint else RandomWeights(seed))
    _finish_fp8(model, stored.quant, quant)
    return model.eval()


def _finish_fp8(model: LlamaForCausalLM, stored: Fp8Scheme | None, wanted: Fp8Scheme | None) -> None:
    """Bring the linear layers to FP8: fuse an FP8 checkpoint's per-part tensorwise scales, or quantise
    high-precision weights (random init, a bf16 checkpoint) for ``build(quant=...)``."""
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            parts = module.local_output_sizes
        elif isinstance(module, RowParallelLinear):
            parts = (module.out_features,)
        else:
            continue
        if stored is not None:
            module.fuse_scales_(parts)
        elif wanted is not None:
            module.quantize_(wanted, RANDOM_INPUT_SCALE)
    if stored is None and wanted is not None:
        model.config = dataclasses.replace(model.config, quant=wanted)
        model.spec = dataclasses.replace(model.spec, quant=wanted.name)
