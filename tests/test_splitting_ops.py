"""Splitting ops of any signature, piecewise under every boundary strategy (2 gloo ranks, against eager).

The ops and the model are defined here, at module level, as a user's own file would define them; the ranks
import this module by name, which registers the ops there too. One op per signature vLLM and users write:

- ``umtest::one(Tensor q) -> Tensor``: a single tensor in and out;
- ``umtest::multi(Tensor q, Tensor k) -> (Tensor, Tensor)``: several outputs;
- ``umtest::scaled(Tensor q, int heads, str layer_name) -> Tensor``: non-tensor arguments;
- ``umtest::attn_out(Tensor q, Tensor k, Tensor v, Tensor(a!) output, str layer_name) -> ()``: writes into an
  ``output`` it is given (vLLM's ``unified_attention_with_output``); AOT wraps it in ``auto_functionalized``.

Every op mixes tokens (a cumulative sum along dim 0), as attention does, so an op handed a token shard
instead of the full tensor gives a different answer.

The same launch compiles models whose forward does not name its tokens: an ``nn.Sequential`` at the top (Dynamo
enters a ``torch.nn`` container through a ``*args`` wrapper, so the tokens are ``args[0]``, not ``input``) and a
``forward(self, *inputs)``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import rank_checks
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import sp_lab
from sp_lab.compiler import split
from sp_lab.compiler.backend import BoundaryError

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "inductor"))

TP = 2
MIN_TOKENS = 8
OPS = ["umtest::one", "umtest::multi", "umtest::scaled", "umtest::attn_out"]


@torch.library.custom_op("umtest::one", mutates_args=())
def one(q: torch.Tensor) -> torch.Tensor:
    return q.cumsum(0) / q.shape[0]


@one.register_fake
def _(q):
    return torch.empty_like(q)


@torch.library.custom_op("umtest::multi", mutates_args=())
def multi(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q.cumsum(0) * k / q.shape[0], q - k.flip(0)


@multi.register_fake
def _(q, k):
    return torch.empty_like(q), torch.empty_like(q)


@torch.library.custom_op("umtest::scaled", mutates_args=())
def scaled(q: torch.Tensor, heads: int, layer_name: str) -> torch.Tensor:
    return q.cumsum(0) * (heads + len(layer_name)) / q.shape[0]


@scaled.register_fake
def _(q, heads, layer_name):
    return torch.empty_like(q)


@torch.library.custom_op("umtest::attn_out", mutates_args=("output",))
def attn_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    output.copy_(q.cumsum(0) * k / q.shape[0] + v * len(layer_name))


@attn_out.register_fake
def _(q, k, v, output, layer_name):
    return None


class Block(nn.Module):
    """``F.linear -> all_reduce -> residual add -> RMSNorm``: one SP site."""

    def __init__(self, hidden: int, g: torch.Generator):
        super().__init__()
        self.w = nn.Parameter(torch.randn(hidden, hidden, generator=g) / hidden**0.5)
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(hidden, generator=g))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + funcol.all_reduce(F.linear(x, self.w), "sum", dist.group.WORLD)
        return F.rms_norm(residual, (residual.shape[-1],), self.norm, 1e-6), residual


class FourOps(nn.Module):
    """x: [T, 16] -> [T, 16]; the four splitting ops between five SP sites."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.blocks = nn.ModuleList(Block(hidden, g) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, r = self.blocks[0](x, x)
        x = torch.ops.umtest.one(x)
        x, r = self.blocks[1](x, r)
        a, b = torch.ops.umtest.multi(x, r)
        x, r = self.blocks[2](a + b, r)
        x = torch.ops.umtest.scaled(x, 2, "layers.2.attn")
        x, r = self.blocks[3](x, r)
        out = torch.empty_like(x)
        torch.ops.umtest.attn_out(x, r, x, out, "layers.3.attn")
        x, _ = self.blocks[4](out, r)
        return x


class RowParallel(nn.Module):
    """``x [T, H] -> all_reduce(x @ w.T)``: a row-parallel linear written with a functional collective."""

    def __init__(self, hidden: int, g: torch.Generator):
        super().__init__()
        self.w = nn.Parameter(torch.randn(hidden, hidden, generator=g) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(F.linear(x, self.w), "sum", dist.group.WORLD)


class One(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.umtest.one(x)


def sequential(hidden: int = 16) -> nn.Sequential:
    """x: [T, 16] -> [T, 16]; two SP sites around a splitting op, as an ``nn.Sequential``."""
    g = torch.Generator().manual_seed(1)
    return nn.Sequential(RowParallel(hidden, g), nn.RMSNorm(hidden), One(), RowParallel(hidden, g), nn.RMSNorm(hidden))


class StarArgs(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.inner(inputs[0])


# (label, compile_mode, boundary)
CASES = [
    ("gather_erase", "piecewise", "gather_erase"),
    ("gather", "piecewise", "gather"),
    ("sharded", "piecewise", "sharded"),
    ("full_graph", "full_graph", "sharded"),
]
COUNTS = (5, 12, 13)  # below the SP threshold; even; odd (padded to a multiple of tp)


def _worker() -> dict[str, Any]:
    torch.manual_seed(0)
    model = FourOps()
    shared = sp_lab.SharedCaptures(model)  # one Dynamo capture, shared by every compile mode and boundary
    results: dict[str, Any] = {}
    for label, mode, boundary in [*CASES, ("none", "piecewise", "none")]:
        config = sp_lab.LabConfig(tp_size=TP, async_tp_min_tokens=MIN_TOKENS, max_num_tokens=64,
                                  splitting_ops=OPS, compile_mode=mode, boundary=boundary)
        compiled = sp_lab.compile(model, config, captures=shared)
        if label == "none":
            try:
                compiled(torch.randn(12, 16))
                results[label] = "no error"
            except BoundaryError as e:
                results[label] = str(e)
            continue
        diffs = {}
        for n in COUNTS:
            x = torch.randn(n, 16, generator=torch.Generator().manual_seed(n))
            with torch.no_grad():
                diffs[n] = (compiled(x) - model(x)).abs().max().item()
        results[label] = _outcome(compiled, diffs)
    seq = sequential()
    for label, model in (("sequential", seq), ("star_args", StarArgs(seq))):
        torch._dynamo.reset()
        compiled = sp_lab.compile(model, sp_lab.LabConfig(tp_size=TP, async_tp_min_tokens=MIN_TOKENS,
                                                          max_num_tokens=64, splitting_ops=["umtest::one"]))
        diffs = {}
        for n in COUNTS[1:]:
            x = torch.randn(n, 16, generator=torch.Generator().manual_seed(n))
            with torch.no_grad():
                diffs[n] = (compiled(x) - model(x)).abs().max().item()
        results[label] = _outcome(compiled, diffs)
    return results


def _outcome(compiled: sp_lab.CompiledModel, diffs: dict[int, float]) -> dict[str, Any]:
    sp_range = compiled.report.range_for(12)
    return {
        "diffs": diffs,
        "split_at": [p.op for p in sp_range.pieces if p.kind == "splitting_op"],
        "op_counts": compiled.report.op_counts(12),
        "sp_rewrites": compiled.report.sp_rewrites(12),
        "fusion_fired": compiled.report.fusion_fired(12),
    }


rank_checks.register(__name__, _worker, timeout=600.0)


@pytest.fixture(scope="module")
def gloo(gloo_checks) -> list[dict[str, Any]]:
    return rank_checks.results_of(gloo_checks, __name__)


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_every_signature_compiles_and_matches_eager(gloo, label):
    for rank, results in enumerate(gloo):
        got = results[label]
        assert max(got["diffs"].values()) < 1e-4, (rank, got["diffs"])
        if label != "full_graph":
            assert got["split_at"] == OPS, got["split_at"]  # each op ran eagerly, between pieces
        counts = got["op_counts"]
        # Five SP sites: every all_reduce became a reduce_scatter, and AsyncTP fused each with its matmul.
        assert counts["all_reduce"] == 0, counts
        assert counts["fused_matmul_reduce_scatter"] == 5, counts
        assert got["fusion_fired"]


def test_boundary_none_still_reports_the_broken_boundary(gloo):
    for results in gloo:
        assert "boundary='none'" in results["none"] and "assert_size_stride" in results["none"], results["none"]


@pytest.mark.parametrize("label", ["sequential", "star_args"])
def test_forward_without_a_named_token_argument_compiles_and_matches_eager(gloo, label):
    for rank, results in enumerate(gloo):
        got = results[label]
        assert max(got["diffs"].values()) < 1e-4, (rank, got["diffs"])
        assert got["split_at"] == ["umtest::one"]
        # Both all_reduces became reduce_scatters fused with their matmuls (SP found the tokens in args[0]).
        assert got["sp_rewrites"] == 2 and got["op_counts"]["fused_matmul_reduce_scatter"] == 2, got["op_counts"]


class SDPAttention(nn.Module):
    """x: [T, 8] -> [T, 8], attention through F.scaled_dot_product_attention (as transformers' "sdpa")."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.qkv(x).view(1, x.shape[0], 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(x.shape[0], 8)


@pytest.mark.parametrize("splitting_ops", [["sp_lab::attention"], ["aten::scaled_dot_product_attention"]])
def test_sdpa_is_no_splitting_op_and_the_log_says_what_to_do(splitting_ops, caplog):
    torch._dynamo.reset()
    split._warn_once.cache_clear()  # logged once per process: another test may have logged it already
    config = sp_lab.LabConfig(tp_size=1, async_tp_min_tokens=8, max_num_tokens=64, splitting_ops=splitting_ops)
    compiled = sp_lab.compile(SDPAttention(), config, inspect_only=True)  # graphs only: no Inductor
    with caplog.at_level("WARNING", logger="sp_lab.compiler.split"):
        compiled(torch.randn(12, 8))
    assert [p.kind for p in compiled.report.range_for(12).pieces] == ["compiled"]
    assert f"splitting_ops={splitting_ops} matched no op" in caplog.text
    assert "attn_implementation=sp_lab.models.register_hf_attention()" in caplog.text
