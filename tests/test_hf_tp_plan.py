"""A Hugging Face model with its own tensor-parallel plan, compiled by sp_lab on 2 gloo ranks.

A tiny random transformers Llama is saved locally and loaded on every rank with
``from_pretrained(path, tp_plan="auto")`` (``sp_lab.models.from_pretrained_tp_plan``, which spells it as the installed
transformers wants): transformers' own plan, parameters as DTensors (this needs ``accelerate``, part of the ``hf``
extra). It is compiled with SP + AsyncTP (``token_dim=1``: transformers runs ``[batch=1, seq]``)
and compared with transformers' unsharded logits:

- with transformers' default attention (SDPA), full graph: SDPA is no splitting op;
- with ``attn_implementation=sp_lab.models.register_hf_attention()``: attention goes through ``sp_lab::attention``,
  so the model compiles piecewise, split at every layer's attention, under every boundary strategy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import rank_checks
import torch

import sp_lab
from sp_lab.compiler.backend import BoundaryError
from sp_lab.models import CausalLMLogits, from_pretrained_tp_plan, register_hf_attention

transformers = pytest.importorskip("transformers")

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "inductor"))

TP = 2
COUNTS = (12, 13)  # even; odd (padded to a multiple of tp). Both in the SP range, one compile.
# (label, attn_implementation, compile_mode, boundary)
CASES = [
    ("sdpa-full_graph", "sdpa", "full_graph", "sharded"),
    ("sp_lab-gather_erase", "sp_lab", "piecewise", "gather_erase"),
    ("sp_lab-gather", "sp_lab", "piecewise", "gather"),
    ("sp_lab-sharded", "sp_lab", "piecewise", "sharded"),
]


def _tiny_llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=256, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 1: perturb everything so a wrongly sharded tensor shows
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def _tiny_qwen2() -> transformers.Qwen2ForCausalLM:
    """Qwen2: Llama-shaped, with biases on q/k/v (``F.linear`` with a bias: ``addmm`` in the graph)."""
    torch.manual_seed(1)
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=256)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # biases start at 0: make them count
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))


def _worker(path: str, qwen2_path: str) -> dict[str, Any]:
    models = {attn: from_pretrained_tp_plan(
        path, dtype=torch.float32, attn_implementation=register_hf_attention() if attn == "sp_lab" else attn).eval()
        for attn in ("sdpa", "sp_lab")}
    results: dict[str, Any] = {"param_type": type(models["sdpa"].model.layers[0].self_attn.q_proj.weight).__name__}
    # One Dynamo capture per attention implementation, shared by its compile modes and boundaries.
    shared = {attn: sp_lab.SharedCaptures(CausalLMLogits(model)) for attn, model in models.items()}
    for label, attn, mode, boundary in [*CASES, ("sp_lab-none", "sp_lab", "piecewise", "none")]:
        config = sp_lab.LabConfig(tp_size=TP, token_dim=1, async_tp_min_tokens=8, max_num_tokens=64,
                                  compile_mode=mode, boundary=boundary)
        compiled = sp_lab.compile(shared[attn].model, config, captures=shared[attn])
        with torch.no_grad():
            if boundary == "none":
                try:
                    compiled(_ids(12))
                    results[label] = "no error"
                except BoundaryError as e:
                    results[label] = str(e)
                continue
            results[label] = {
                "eager": {n: CausalLMLogits(models[attn])(_ids(n)) for n in COUNTS},
                "compiled": {n: compiled(_ids(n)) for n in COUNTS},
                "pieces": [p.kind if p.kind != "splitting_op" else p.op for p in compiled.report.range_for(12).pieces],
                "op_counts": compiled.report.op_counts(12),
                "sp_rewrites": compiled.report.sp_rewrites(12),
            }
    qwen2 = from_pretrained_tp_plan(qwen2_path, dtype=torch.float32, attn_implementation=register_hf_attention()).eval()
    torch._dynamo.reset()
    compiled = sp_lab.compile(CausalLMLogits(qwen2), sp_lab.LabConfig(tp_size=TP, token_dim=1, async_tp_min_tokens=8,
                                                                      max_num_tokens=64, boundary="sharded"))
    with torch.no_grad():
        results["qwen2"] = {"compiled": compiled(_ids(13)), "op_counts": compiled.report.op_counts(13)}
    return results


def _saved_checkpoints() -> tuple[str, str]:
    """The tiny Llama and Qwen2 written as HF checkpoints (temporary directories removed when the tests end)."""
    paths = []
    for name, build in (("tiny_llama", _tiny_llama), ("tiny_qwen2", _tiny_qwen2)):
        path = str(rank_checks.scratch_dir(f"{name}_"))
        build().save_pretrained(path)
        paths.append(path)
    return tuple(paths)


rank_checks.register(__name__, _worker, prepare=_saved_checkpoints, timeout=900.0)


@pytest.fixture(scope="module")
def hf(gloo_checks) -> tuple[dict[int, torch.Tensor], list[dict[str, Any]]]:
    model, qwen2 = _tiny_llama(), _tiny_qwen2()  # seeded: the weights the ranks loaded from the checkpoints
    with torch.no_grad():
        expected = {n: model(_ids(n)).logits for n in COUNTS} | {"qwen2": qwen2(_ids(13)).logits}
    return expected, rank_checks.results_of(gloo_checks, __name__)


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_hf_llama_with_its_tp_plan_matches_unsharded_logits(hf, label):
    expected, ranks = hf
    for rank in ranks:
        assert rank["param_type"] == "DTensor"
        got = rank[label]
        for n in COUNTS:
            assert (got["eager"][n] - expected[n]).abs().max().item() < 1e-5
            assert (got["compiled"][n] - expected[n]).abs().max().item() < 1e-4, (label, n)
        # Two layers x (o_proj + down_proj) all_reduces, plus the embedding's: transformers' plan shards it over
        # the vocabulary, so it sums partial lookups. All five become reduce_scatters; the four after a matmul fuse
        # with it, the embedding's has no matmul before it.
        counts = got["op_counts"]
        assert got["sp_rewrites"] == 5
        assert counts["all_reduce"] == 0 and counts["fused_matmul_reduce_scatter"] == 4, counts
        assert counts["reduce_scatter"] == 1, counts
        # The logits need every token (one all-gather); gather and gather_erase also gather the residual at both
        # attention boundaries, sharded carries it across as a token shard.
        assert counts["all_gather"] == (3 if label in ("sp_lab-gather", "sp_lab-gather_erase") else 1), counts
        assert counts["fused_all_gather_matmul"] > 0, counts


def test_hf_qwen2_matmuls_with_bias_fuse_with_their_all_gathers(hf):
    expected, ranks = hf
    for rank in ranks:
        got = rank["qwen2"]
        assert (got["compiled"] - expected["qwen2"]).abs().max().item() < 1e-4
        # q, k, v (with biases: addmm), gate and up of both layers and the LM head read gathered shards: all 11
        # fuse (without the addmm pattern the 6 biased ones stayed plain matmuls, each with its own all_gather).
        counts = got["op_counts"]
        assert (counts["fused_all_gather_matmul"], counts["mm"], counts["fused_matmul_reduce_scatter"]) == (11, 0, 4), counts


@pytest.mark.parametrize("label", [c[0] for c in CASES if c[1] == "sp_lab"])
def test_sp_lab_attention_splits_the_hf_model_at_every_layer(hf, label):
    _, ranks = hf
    for rank in ranks:
        assert rank[label]["pieces"] == ["compiled", "sp_lab::attention"] * 2 + ["compiled"]


def test_sdpa_model_compiles_as_one_piece(hf):
    _, ranks = hf
    assert all(rank["sdpa-full_graph"]["pieces"] == ["compiled"] for rank in ranks)


def test_boundary_none_reports_the_broken_boundary_of_an_hf_model(hf):
    _, ranks = hf
    for rank in ranks:
        assert "boundary='none'" in rank["sp_lab-none"] and "assert_size_stride" in rank["sp_lab-none"]


# -- in process: the attention function alone --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> transformers.LlamaForCausalLM:
    return _tiny_llama()


def test_sp_lab_attention_matches_sdpa_unsharded(tiny):
    with torch.no_grad():
        expected = tiny(_ids(12)).logits
        tiny.config._attn_implementation = register_hf_attention()
        try:
            got = tiny(_ids(12), use_cache=False).logits
        finally:
            tiny.config._attn_implementation = "sdpa"
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize(("call", "named"), [
    (lambda m: m(_ids(12), attention_mask=torch.ones(1, 12, dtype=torch.long), use_cache=False), "attention_mask"),
    (lambda m: m(torch.cat([_ids(12), _ids(12)]), use_cache=False), "batch"),
    (lambda m: m(_ids(1), past_key_values=m(_ids(12), use_cache=True).past_key_values), "KV cache"),
])
def test_sp_lab_attention_refuses_what_it_cannot_compute(tiny, call, named):
    tiny.config._attn_implementation = register_hf_attention()
    try:
        with torch.no_grad(), pytest.raises(ValueError, match=f"attn_implementation='sp_lab' got {named}"):
            call(tiny)
    finally:
        tiny.config._attn_implementation = "sdpa"


def test_sliding_window_attention_within_its_window_is_causal_attention():
    torch.manual_seed(0)
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        max_position_embeddings=256, sliding_window=16)
    model = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():
        expected = model(_ids(12)).logits
        model.config._attn_implementation = register_hf_attention()
        got = model(_ids(12), use_cache=False).logits
        with pytest.raises(ValueError, match="got a sequence longer than the sliding window"):
            model(_ids(17), use_cache=False)
    assert (got - expected).abs().max().item() < 1e-5


def test_register_hf_attention_names_what_an_older_transformers_lacks(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)  # as if transformers had no such module
    with pytest.raises(ImportError, match="masking_utils.AttentionMaskInterface"):
        register_hf_attention()
