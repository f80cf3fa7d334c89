"""Tensor-parallel models written the way PyTorch users write them, for the DTensor tests.

``TinyTitan`` is a torchtitan-style Llama (``tok_embeddings``, ``layers.N.attention.wq``, ``feed_forward.w1``,
...) on ``[batch=1, seq, dim]`` activations. Its attention runs in a custom op of this file (``titan::attention``,
SDPA inside) so that piecewise compilation has something to split at. The plans are
``torch.distributed.tensor.parallel`` plans; the ranks import this module by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

ATTENTION_OP = "titan::attention"


@torch.library.custom_op(ATTENTION_OP, mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention, q/k/v ``[batch, heads, seq, head_dim]``."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, seq, _ = x.shape
        # -1: the heads of this rank once wq/wk/wv are column-sharded.
        q, k, v = (w(x).view(b, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = torch.ops.titan.attention(q, k, v).transpose(1, 2).reshape(b, seq, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        self.attention = Attention(dim, n_heads)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TinyTitan(nn.Module):
    """tokens ``[1, seq]`` -> logits ``[1, seq, vocab]``; random weights, the same on every rank for a seed."""

    def __init__(self, dim: int = 32, n_layers: int = 2, n_heads: int = 4, hidden: int = 64, vocab: int = 64,
                 seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.output = nn.Linear(dim, vocab, bias=False)
        with torch.no_grad():  # norms start at 1: perturb so that a wrong shard of a norm weight shows
            for layer in [*self.layers, self]:
                for norm in (m for m in layer.modules() if isinstance(m, nn.RMSNorm)):
                    norm.weight.add_(0.1 * torch.randn_like(norm.weight))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def tp_plan(*, local_ffn: bool = True) -> dict:
    """Megatron-style TP, no sequence parallelism: DTensor inserts one all_reduce per row-parallel layer.

    ``local_ffn=False`` keeps the FFN's intermediates as DTensors (``use_local_output=False``). The attention
    module's input and output go through ``PrepareModuleInput`` / ``PrepareModuleOutput`` (no-op layouts here,
    but the DTensor conversions are in the graph)."""
    plan = {}
    for i in (0, 1):
        plan.update({
            f"layers.{i}.attention": PrepareModuleInput(input_layouts=(Replicate(),),
                                                        desired_input_layouts=(Replicate(),)),
            f"layers.{i}.attention.wq": ColwiseParallel(),
            f"layers.{i}.attention.wk": ColwiseParallel(),
            f"layers.{i}.attention.wv": ColwiseParallel(),
            f"layers.{i}.attention.wo": RowwiseParallel(),
            f"layers.{i}.feed_forward.w1": ColwiseParallel(use_local_output=local_ffn),
            f"layers.{i}.feed_forward.w3": ColwiseParallel(use_local_output=local_ffn),
            f"layers.{i}.feed_forward.w2": RowwiseParallel(),
        })
        plan[f"layers.{i}.feed_forward"] = PrepareModuleOutput(output_layouts=(Replicate(),),
                                                               desired_output_layouts=(Replicate(),))
    return plan


def titan_sp_plan() -> dict:
    """torchtitan's Llama plan: sequence parallel norms, DTensor's own all_gather / reduce_scatter."""
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in (0, 1):
        plan.update({
            f"layers.{i}.attention_norm": SequenceParallel(),
            f"layers.{i}.attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                                        desired_input_layouts=(Replicate(),)),
            f"layers.{i}.attention.wq": ColwiseParallel(),
            f"layers.{i}.attention.wk": ColwiseParallel(),
            f"layers.{i}.attention.wv": ColwiseParallel(),
            f"layers.{i}.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            f"layers.{i}.ffn_norm": SequenceParallel(),
            f"layers.{i}.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                           desired_input_layouts=(Replicate(),)),
            f"layers.{i}.feed_forward.w1": ColwiseParallel(),
            f"layers.{i}.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            f"layers.{i}.feed_forward.w3": ColwiseParallel(),
        })
    return plan


PLANS = {"tp": tp_plan, "tp_dtensor_ffn": lambda: tp_plan(local_ffn=False), "titan_sp": titan_sp_plan}


def parallel_titan(plan: str, world_size: int) -> TinyTitan:
    """A TinyTitan parallelised with ``PLANS[plan]`` over a 1-D CPU mesh of ``world_size`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    model = TinyTitan()
    return parallelize_module(model, init_device_mesh("cpu", (world_size,)), PLANS[plan]())


# -- FP8, written as vLLM runs it on Hopper, in plain PyTorch -------------------------------------------------

FP8 = torch.float8_e4m3fn


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` -> ``(x_fp8, scale)``: dynamic per-token scales ``[T, 1]``, or the given static scalar."""
    if scale is None:
        scale = (x.abs().amax(-1, keepdim=True).float() / 448.0).clamp(min=1e-12)
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8), scale


class Fp8Stack(nn.Module):
    """A tensor-parallel FP8 MLP stack on ``[T, H]`` bf16 activations, no sp_lab layer in it.

    Per layer: RMSNorm -> column-parallel ``torch._scaled_mm`` (+ bias, as Qwen2's q/k/v) -> SiLU ->
    row-parallel ``torch._scaled_mm`` -> functional all_reduce -> residual add. Rowwise: per-channel weight
    and per-token activation scales; tensorwise: scalar weight and static activation scales. The full
    weights are drawn from ``seed`` and sliced per rank, then each rank quantises its own slice (``_quantize``):
    the high-precision model is the same at every tp, the FP8 one is not (compare a tp with itself, compiled
    against eager).
    """

    def __init__(self, *, tp: int = 1, rank: int = 0, tensorwise: bool = False, hidden: int = 32, inner: int = 64,
                 layers: int = 2, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.tp, self.tensorwise = tp, tensorwise
        self.input_scale = torch.tensor(8.0 / 448.0)
        cols, rows = slice(rank * inner // tp, (rank + 1) * inner // tp), slice(rank * inner // tp, (rank + 1) * inner // tp)
        self.layers = []
        for _ in range(layers):
            up, down = torch.randn(inner, hidden, generator=g) / hidden**0.5, torch.randn(hidden, inner, generator=g) / inner**0.5
            bias = 0.1 * torch.randn(inner, generator=g)
            norm = 1 + 0.1 * torch.randn(hidden, generator=g)
            self.layers.append((*self._quantize(up[cols]), bias[cols].bfloat16(), *self._quantize(down[:, rows]),
                                norm.bfloat16()))

    def _quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # A real checkpoint's per-channel scale comes from the full row; for the row-parallel weight each rank's
        # slice is scaled on its own here, which is still an exact FP8 model of its own.
        scale = (w.abs().amax() if self.tensorwise else w.abs().amax(-1, keepdim=True)) / 448.0
        return (w / scale).to(FP8), scale.float().reshape(1, -1) if not self.tensorwise else scale.float()

    def _scaled(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias=None) -> torch.Tensor:
        x_fp8, x_scale = quantize_fp8(x, self.input_scale if self.tensorwise else None)
        return torch._scaled_mm(x_fp8, w.t(), x_scale, w_scale, bias=bias, out_dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        residual = x
        for up, up_scale, bias, down, down_scale, norm in self.layers:
            h = F.rms_norm(residual, (residual.shape[-1],), norm, 1e-6)
            h = F.silu(self._scaled(h, up, up_scale, bias))
            out = self._scaled(h, down, down_scale)
            if self.tp > 1:
                out = funcol.all_reduce(out, "sum", dist.group.WORLD)
            residual = residual + out
        return residual
