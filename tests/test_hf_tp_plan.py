"""A Hugging Face model with its own tensor-parallel plan, compiled by sp_lab on 2 gloo ranks.

A tiny random transformers Llama is saved locally and loaded on every rank two ways:

- ``from_pretrained(path, tp_plan="auto")``: transformers' own plan, parameters as DTensors. transformers 5.x
  refuses this without ``accelerate`` installed ("Using a `device_map`, `tp_plan`, ... requires `accelerate`"),
  so that case is skipped where accelerate is missing;
- the same model parallelised by hand with ``parallelize_module`` from ``config.base_model_tp_plan``
  (``"colwise"`` -> ``ColwiseParallel()``, ``"rowwise"`` -> ``RowwiseParallel()``), which needs nothing more.

Both are compiled with SP + AsyncTP (``token_dim=1``: transformers runs ``[batch=1, seq]``) and compared with
transformers' unsharded logits.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import sp_lab

transformers = pytest.importorskip("transformers")

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "inductor"))

TP = 2
NUM_TOKENS = 12
HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None


class Logits(torch.nn.Module):
    """``input_ids [1, T] -> logits [1, T, vocab]`` (no KV cache): the call sp_lab compiles."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def parallelize_from_base_plan(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    """Apply ``model.config.base_model_tp_plan`` with PyTorch's own ColwiseParallel / RowwiseParallel."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {f"model.{name}": styles[style]() for name, style in model.config.base_model_tp_plan.items()}
    return parallelize_module(model, init_device_mesh("cpu", (world_size,)), plan)


def _worker(path: str, ids: torch.Tensor, use_tp_plan: bool) -> dict[str, Any]:
    config = sp_lab.LabConfig(tp_size=TP, token_dim=1, async_tp_min_tokens=8, max_num_tokens=64,
                              compile_mode="full_graph")
    results = {}
    loads = {"base_model_tp_plan": lambda: parallelize_from_base_plan(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), TP)}
    if use_tp_plan:
        loads["tp_plan_auto"] = lambda: transformers.AutoModelForCausalLM.from_pretrained(
            path, tp_plan="auto", dtype=torch.float32)
    for name, load in loads.items():
        torch._dynamo.reset()
        model = load().eval()
        compiled = sp_lab.compile(Logits(model), config)
        with torch.no_grad():
            results[name] = {
                "param_type": type(model.model.layers[0].self_attn.q_proj.weight).__name__,
                "eager": Logits(model)(ids),
                "compiled": compiled(ids),
                "op_counts": compiled.report.op_counts(NUM_TOKENS),
                "sp_rewrites": compiled.report.sp_rewrites(NUM_TOKENS),
            }
    return results


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=256, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1: perturb everything so a wrongly sharded tensor shows
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    ids = torch.randint(0, 128, (1, NUM_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    return expected, sp_lab.launch(_worker, str(path), ids, HAS_ACCELERATE, world_size=TP, timeout=900.0)


@pytest.mark.parametrize("load", [
    "base_model_tp_plan",
    pytest.param("tp_plan_auto", marks=pytest.mark.skipif(not HAS_ACCELERATE, reason=(
        "transformers' tp_plan='auto' needs accelerate: 'Using a `device_map`, `tp_plan`, `torch.device` context "
        "manager or setting `torch.set_default_device(device)` requires `accelerate`'"))),
])
def test_hf_llama_with_its_tp_plan_matches_unsharded_logits(hf, load):
    expected, ranks = hf
    for rank in ranks:
        got = rank[load]
        assert got["param_type"] == "DTensor"
        assert (got["eager"] - expected).abs().max().item() < 1e-5
        assert (got["compiled"] - expected).abs().max().item() < 1e-4
        # Two layers x (o_proj + down_proj): four all_reduces rewritten by SP, each fused with its matmul.
        # transformers' own plan also shards the embedding over the vocabulary: its all_reduce becomes a fifth
        # reduce_scatter, with no matmul before it to fuse.
        assert got["sp_rewrites"] == {"base_model_tp_plan": 4, "tp_plan_auto": 5}[load]
        assert got["op_counts"]["all_reduce"] == 0 and got["op_counts"]["fused_matmul_reduce_scatter"] == 4
        assert got["op_counts"]["fused_all_gather_matmul"] > 0
