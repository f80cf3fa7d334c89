"""Llama-family decoders (Llama 2/3, Mistral, Qwen2) in vLLM's tensor-parallel layout.

One builder serves every preset: Mistral is Llama-shaped, Qwen2 adds biases to q/k/v. The module
tree mirrors Hugging Face's (``model.embed_tokens``, ``model.layers.N.self_attn``, ``lm_head``) so
checkpoint names map onto it directly; the only differences are vLLM's fused projections
(``qkv_proj`` = q|k|v, ``gate_up_proj`` = gate|up), which :mod:`sp_lab.models.checkpoint` assembles
from the separate HF tensors.

Per layer, the communication is exactly the two all_reduces sequence parallelism rewrites:
after ``o_proj`` and after ``down_proj``; plus one after the embedding and an all_gather of the logits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sp_lab.models.attention import attention  # noqa: F401  (registers torch.ops.sp_lab.attention)
from sp_lab.models.fp8 import Fp8Scheme, quant_from_hf
from sp_lab.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    silu_and_mul,
)

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderConfig", "LlamaForCausalLM", "ModelSpec"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(kw_only=True)
class DecoderConfig:
    """Shapes and numerics of a Llama-style decoder (unsharded, i.e. as in the HF config)."""

    name: str
    """Label carried into :class:`ModelSpec` (preset name, ``"toy"`` or the checkpoint directory)."""
    hidden_size: int
    """Residual stream width ``H``."""
    intermediate_size: int
    """MLP width ``I`` (gate and up each project ``H -> I``)."""
    num_layers: int
    """Number of decoder layers (HF ``num_hidden_layers``)."""
    num_heads: int
    """Query heads (HF ``num_attention_heads``)."""
    num_kv_heads: int
    """Key/value heads; ``num_heads / num_kv_heads`` query heads share each (GQA)."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    head_dim: int | None = None
    """Per-head width as configured; ``None`` means ``hidden_size // num_heads`` (HF's default).
    Kept unresolved so that overriding ``hidden_size``/``num_heads`` re-derives it; use :attr:`head_size`."""
    rms_norm_eps: float = 1e-5
    """Epsilon inside every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """HF ``rope_scaling`` dict; ``None``/``"default"`` or ``"llama3"`` are supported."""
    max_position_embeddings: int = 4096
    """Longest sequence the model was trained for (informational; RoPE is computed on the fly)."""
    tie_word_embeddings: bool = False
    """LM head reuses the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections have biases (Qwen2)."""
    residual_inplace: bool = False
    """Fused add+norm updates the residual with ``add_`` (vLLM's kernel) instead of out of place."""
    model_type: str = "llama"
    """HF ``model_type``: one of ``SUPPORTED_MODEL_TYPES``."""
    quant: Fp8Scheme | None = None
    """FP8 matmuls (q/k/v, o, gate_up, down; the embedding and LM head stay in the model dtype, as in public
    FP8 checkpoints): from the checkpoint's ``quantization_config`` or ``build(quant=...)``."""
    source: str = ""
    """Where the numbers come from (a URL for presets, a path for checkpoints)."""

    def __post_init__(self) -> None:
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}; "
                "set head_dim explicitly"
            )
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "vocab_size",
        ):
            value = getattr(self, key)
            # an int, not 2.5 (int() would truncate it) nor "2": a sweep row records it as the int it builds
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA groups)"
            )
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        # Validate rope_scaling now rather than at the first forward.
        RotaryEmbedding(self.head_size, self.rope_theta, self.rope_scaling, device="meta")

    @property
    def head_size(self) -> int:
        """The per-head width in effect: ``head_dim`` or ``hidden_size // num_heads``."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def tp_sharded_sizes(self) -> dict[str, int]:
        """Every dimension tensor parallelism splits into equal per-rank shares, by the name errors use:
        query and key/value heads (attention), the MLP width (gate_up / down) and the vocabulary
        (embedding and LM head)."""
        return {
            "num_heads (num_attention_heads)": self.num_heads,
            "num_kv_heads (num_key_value_heads)": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
        }

    def tp_sizes(self, limit: int = 64) -> list[int]:
        """The tp sizes up to ``limit`` that divide every sharded dimension at once (the divisors of
        their greatest common divisor): e.g. ``[1, 2, 4, 8]`` for Llama-3-8B (32 heads, 8 kv heads)."""
        common = math.gcd(*self.tp_sharded_sizes().values())
        return [d for d in range(1, min(common, limit) + 1) if common % d == 0]

    def check_tp_size(self, tp_size: int) -> None:
        """Raise ``ValueError`` naming every dimension ``tp_size`` does not divide and the sizes that
        divide them all; checked before any layer is built, so one error says everything."""
        refused = {what: size for what, size in self.tp_sharded_sizes().items() if size % tp_size}
        if refused:
            listed = ", ".join(f"{what}={size}" for what, size in refused.items())
            raise ValueError(
                f"tp_size={tp_size} does not divide {listed}; tensor parallelism needs every rank to hold "
                f"an equal share of the heads, kv heads, intermediate_size and vocab_size. tp_size values "
                f"that work for this model: {self.tp_sizes()}"
            )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names accepted as overrides by :func:`sp_lab.models.build`."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, name: str, source: str = "") -> DecoderConfig:
        """Read a Hugging Face ``config.json`` dict (transformers 4.x ``rope_theta``/``rope_scaling``
        or 5.x ``rope_parameters`` form).

        Mistral's ``sliding_window`` is not modelled: attention is full causal, which is exact for
        sequences no longer than the window (4096 tokens for Mistral-7B-v0.1; v0.3 has none).
        """
        model_type = hf.get("model_type", "llama")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported; only 'silu' (SwiGLU) is")
        if hf.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported; Llama-family MLPs have no bias")
        missing = [
            k
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "vocab_size",
            )
            if k not in hf
        ]
        if missing:
            raise ValueError(f"config of {name!r} lacks required field(s) {missing}")
        rope = dict(hf.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_scaling = rope or hf.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        return cls(
            name=name,
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            vocab_size=hf["vocab_size"],
            head_dim=hf.get("head_dim"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; its config has no attention_bias field.
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            model_type=model_type,
            quant=quant_from_hf(hf),
            source=source or hf.get("_source", ""),
        )


@dataclass(frozen=True)
class ModelSpec:
    """What a built model is, in the unsharded numbers a report or plot needs.

    The rest (tp size, rope, provenance) is on ``model.tp`` and ``model.config``.
    """

    name: str
    """Preset name, ``"toy"`` or checkpoint directory."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """MLP width."""
    num_layers: int
    """Decoder layers actually built (after any ``num_layers`` override)."""
    num_heads: int
    """Query heads across all ranks."""
    num_kv_heads: int
    """KV heads across all ranks."""
    head_dim: int
    """Per-head width."""
    vocab_size: int
    """Vocabulary size (logits width)."""
    dtype: str
    """Parameter dtype, e.g. ``"float32"``, ``"bfloat16"``."""
    residual_inplace: bool
    """Whether the fused add+norm mutates the residual in place."""
    quant: str | None = None
    """``"fp8-rowwise"`` / ``"fp8-tensorwise"`` when the matmuls run in FP8 (``dtype`` is then the
    activations' and the matmul outputs' dtype)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form."""
        return dataclasses.asdict(self)


class LlamaAttention(nn.Module):
    """Fused QKV (column-parallel) -> RoPE -> ``sp_lab::attention`` -> o_proj (row-parallel + all_reduce).

    Shapes: ``[T, H]`` -> ``[T, H]``; this rank holds ``num_heads/tp`` query and ``num_kv_heads/tp``
    KV heads.
    """

    def __init__(self, cfg: DecoderConfig, *, tp: TensorParallel, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.num_heads = tp.shard(cfg.num_heads, "num_heads (num_attention_heads)")
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_kv_heads (num_key_value_heads)")
        self.head_dim = cfg.head_size
        self.scale = cfg.head_size**-0.5
        q_size, kv_size = cfg.num_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [q_size, kv_size, kv_size],
            tp=tp,
            checkpoint_names=("q_proj", "k_proj", "v_proj"),
            bias=cfg.attention_bias,
            dtype=dtype,
            device=device,
            quant=cfg.quant,
        )
        self.o_proj = RowParallelLinear(
            q_size, cfg.hidden_size, tp=tp, checkpoint_name="o_proj", dtype=dtype, device=device, quant=cfg.quant
        )
        self.rotary_emb = RotaryEmbedding(cfg.head_size, cfg.rope_theta, cfg.rope_scaling, device=device)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(list(self.qkv_proj.local_output_sizes), dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out = torch.ops.sp_lab.attention(q, k, v, self.num_heads, self.num_kv_heads, self.scale)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """SwiGLU MLP: gate_up (column-parallel) -> ``silu(gate) * up`` -> down (row-parallel + all_reduce)."""

    def __init__(self, cfg: DecoderConfig, *, tp: TensorParallel, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.intermediate_size, cfg.intermediate_size],
            tp=tp,
            checkpoint_names=("gate_proj", "up_proj"),
            dtype=dtype,
            device=device,
            quant=cfg.quant,
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size,
            cfg.hidden_size,
            tp=tp,
            checkpoint_name="down_proj",
            dtype=dtype,
            device=device,
            quant=cfg.quant,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(hidden)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder layer in vLLM's residual form: ``hidden, residual = norm(x, residual)``."""

    def __init__(self, cfg: DecoderConfig, *, tp: TensorParallel, dtype: torch.dtype, device) -> None:
        super().__init__()
        norm = {"residual_inplace": cfg.residual_inplace, "dtype": dtype, "device": device}
        self.input_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, checkpoint_name="input_layernorm", **norm
        )
        self.self_attn = LlamaAttention(cfg, tp=tp, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, checkpoint_name="post_attention_layernorm", **norm
        )
        self.mlp = LlamaMLP(cfg, tp=tp, dtype=dtype, device=device)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [T, H]`` is the previous layer's MLP output (or the embedding when ``residual`` is None)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.*`` subtree)."""

    def __init__(self, cfg: DecoderConfig, *, tp: TensorParallel, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, tp=tp, checkpoint_name="embed_tokens", dtype=dtype, device=device
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, tp=tp, dtype=dtype, device=device) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(
            cfg.hidden_size,
            cfg.rms_norm_eps,
            checkpoint_name="norm",
            residual_inplace=cfg.residual_inplace,
            dtype=dtype,
            device=device,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """A tensor-parallel Llama-family causal LM: ``model(input_ids [T]) -> logits [T, vocab_size]``.

    ``input_ids`` is one causal sequence at positions ``0..T-1``; every rank gets the full logits.
    Parameters are created uninitialised; :func:`sp_lab.models.build` fills them.
    """

    def __init__(
        self,
        cfg: DecoderConfig,
        *,
        tp: TensorParallel | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        tp = tp or TensorParallel()
        self.config = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, tp=tp, dtype=dtype, device=device)
        self.lm_head = ParallelLMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            tp=tp,
            checkpoint_name="lm_head",
            tie_to=self.model.embed_tokens if cfg.tie_word_embeddings else None,
            dtype=dtype,
            device=device,
        )
        self.spec = ModelSpec(
            name=cfg.name,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_size,
            vocab_size=cfg.vocab_size,
            dtype=str(dtype).removeprefix("torch."),
            residual_inplace=cfg.residual_inplace,
            quant=cfg.quant.name if cfg.quant else None,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]`` (int64) -> logits ``[T, vocab_size]``."""
        if input_ids.dim() != 1:
            raise ValueError(
                f"input_ids must be 1-D [num_tokens] (one flattened sequence), got shape {tuple(input_ids.shape)}"
            )
        positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        return self.lm_head(self.model(input_ids, positions))
