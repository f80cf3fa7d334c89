"""sp_lab.models: TP layers, the attention op, build(), random-init sharding, presets, 2-rank parity.

Tolerance for TP vs unsharded logits (float32): atol 1e-5, rtol 1e-4. The only difference between
the two is the summation order of the row-parallel all_reduces (two partial sums instead of one
matmul), measured at ~2e-7 on the toy.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import sp_lab
from sp_lab import models
from sp_lab.models import checkpoint
from sp_lab.models.layers import TensorParallel

ATOL, RTOL = 1e-5, 1e-4

# Published parameter counts of the real models: the presets must reproduce them exactly.
PRESET_PARAMS = {
    "llama-2-7b": 6_738_415_616,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "mistral-7b": 7_248_023_552,
    "qwen2.5-7b": 7_615_616_512,
}


def _ids(num_tokens: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (num_tokens,), generator=torch.Generator().manual_seed(seed))


def _capture(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.fx.GraphModule:
    """Dynamo's graph of ``model`` (fullgraph, dynamic token count)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(input_ids, 0)
    torch.compile(model, fullgraph=True, backend=backend)(input_ids)
    return graphs[0]


def _op_counts(gm: torch.fx.GraphModule) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


# --------------------------------------------------------------------------------------------------
# The attention op


def _reference_attention(q, k, v, num_heads, num_kv_heads, scale):
    """Plain softmax attention written out, for comparison with the op."""
    T, D = q.shape[0], q.shape[1] // num_heads
    q = q.view(T, num_heads, D)
    k = k.view(T, num_kv_heads, D).repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.view(T, num_kv_heads, D).repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, num_heads * D)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_attention_op_is_causal_gqa_attention(num_heads, num_kv_heads):
    g = torch.Generator().manual_seed(0)
    T, D = 7, 8
    q = torch.randn(T, num_heads * D, generator=g)
    k, v = (torch.randn(T, num_kv_heads * D, generator=g) for _ in range(2))
    out = torch.ops.sp_lab.attention(q, k, v, num_heads, num_kv_heads, D**-0.5)
    torch.testing.assert_close(out, _reference_attention(q, k, v, num_heads, num_kv_heads, D**-0.5))
    # Causality: the first token's output depends on nothing after it.
    k2, v2 = k.clone(), v.clone()
    k2[1:], v2[1:] = 0.0, 0.0
    torch.testing.assert_close(
        torch.ops.sp_lab.attention(q, k2, v2, num_heads, num_kv_heads, D**-0.5)[0], out[0]
    )


def test_attention_op_passes_opcheck_and_has_meta_kernel():
    q, k, v = torch.randn(5, 32), torch.randn(5, 16), torch.randn(5, 16)
    torch.library.opcheck(torch.ops.sp_lab.attention.default, (q, k, v, 4, 2, 0.35))
    out = torch.ops.sp_lab.attention(q.to("meta"), k.to("meta"), v.to("meta"), 4, 2, 0.35)
    assert out.shape == (5, 32) and out.device.type == "meta"


# --------------------------------------------------------------------------------------------------
# build(): toy, spec, reproducibility, layers


def test_toy_forward_shapes_and_spec():
    model = models.build("toy")
    logits = model(_ids(11, 256))
    assert logits.shape == (11, 256) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all() and 0.01 < logits.std() < 10
    assert model.spec == models.ModelSpec(
        name="toy",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=256,
        dtype="float32",
        residual_inplace=False,
    )
    assert model.spec.to_dict()["head_dim"] == 16
    assert not any(p.requires_grad for p in model.parameters())


def test_toy_overrides_and_residual_forms_agree():
    ids = _ids(9, 256)
    base = models.build("toy", seed=3)(ids)
    inplace = models.build("toy", seed=3, residual_inplace=True)
    assert inplace.spec.residual_inplace
    torch.testing.assert_close(inplace(ids), base, atol=0, rtol=0)
    wide = models.build("toy", num_layers=3, hidden_size=96, num_heads=6, num_kv_heads=3)
    assert wide.spec.num_layers == 3 and wide(ids).shape == (9, 256)


def test_seed_makes_weights_reproducible():
    a, b, c = (models.build("toy", seed=s).state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_bf16_model_is_rounded_fp32_model():
    ids = _ids(8, 256)
    fp32, bf16 = models.build("toy"), models.build("toy", dtype=torch.bfloat16)
    w32, w16 = fp32.model.layers[0].mlp.down_proj.weight, bf16.model.layers[0].mlp.down_proj.weight
    assert torch.equal(w32.to(torch.bfloat16), w16)
    logits = bf16(ids)
    assert logits.dtype == torch.bfloat16 and bf16.spec.dtype == "bfloat16"
    torch.testing.assert_close(logits.float(), fp32(ids), atol=0.05, rtol=0.05)


def test_rmsnorm_fused_add_forms():
    from sp_lab.models.layers import RMSNorm

    x, res = torch.randn(4, 8), torch.randn(4, 8)
    plain = RMSNorm(8, 1e-6, checkpoint_name="n")
    plain.weight.copy_(torch.linspace(0.5, 1.5, 8))
    inplace = RMSNorm(8, 1e-6, checkpoint_name="n", residual_inplace=True)
    inplace.weight.copy_(plain.weight)
    expected = F.rms_norm(x + res, (8,), plain.weight, eps=1e-6)
    out, new_res = plain(x, res.clone())
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(new_res, x + res)
    res_buf = res.clone()
    out2, new_res2 = inplace(x, res_buf)
    assert new_res2.data_ptr() == res_buf.data_ptr()  # updated in place, as vLLM's kernel does
    torch.testing.assert_close(out2, expected)
    torch.testing.assert_close(plain(x), F.rms_norm(x, (8,), plain.weight, eps=1e-6))


# --------------------------------------------------------------------------------------------------
# Random-init sharding: a tp shard is exactly a slice of the unsharded tensor


def _unshard(name: str, shards: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Reassemble a non-fused parameter from per-rank state dicts, following the layer layout."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):  # row-parallel: input features split
        return torch.cat([s[name] for s in shards], dim=1)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):  # vocab rows split
        return torch.cat([s[name] for s in shards], dim=0)
    for shard in shards[1:]:  # replicated (norms)
        assert torch.equal(shard[name], shards[0][name]), name
    return shards[0][name]


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_shards_are_slices_of_unsharded_model(tp_size, monkeypatch):
    # Small blocks so shard boundaries fall inside random-init blocks (the hard case).
    monkeypatch.setattr(checkpoint, "BLOCK_ELEMENTS", 1000)
    kw = {"seed": 5, "attention_bias": True, "num_heads": 8, "num_kv_heads": 4, "hidden_size": 64}
    full = models.build("toy", **kw).state_dict()
    shards = [models.build("toy", tp_rank=r, tp_size=tp_size, **kw).state_dict() for r in range(tp_size)]
    assert set(shards[0]) == set(full)
    for name, value in full.items():
        if "qkv_proj" in name or "gate_up_proj" in name:
            sizes = [64, 32, 32] if "qkv_proj" in name else [128, 128]
            parts = value.split(sizes)
            for rank, shard in enumerate(shards):
                local = shard[name].split([s // tp_size for s in sizes])
                for part, piece in zip(parts, local):
                    assert torch.equal(piece, part.chunk(tp_size)[rank]), name
        else:
            assert torch.equal(_unshard(name, shards), value), name


def test_large_preset_shard_builds_alone():
    # A 1-layer llama-3-8b-shaped rank-1-of-8 shard: 16032 x 4096 embedding rows, no full tensors.
    model = models.build("llama-3-8b", num_layers=1, tp_rank=1, tp_size=8, intermediate_size=1024)
    emb = model.model.embed_tokens.weight
    assert emb.shape == (16032, 4096) and 0.015 < emb.std() < 0.025
    # Row 0 of rank 1 is row 16032 of the full tensor: recompute it from the block scheme alone.
    from sp_lab.models.layers import TensorSlice

    row = torch.empty(1, 4096)
    checkpoint.RandomWeights(0).fill(
        TensorSlice("model.embed_tokens.weight", (128256, 4096), 0, 16032, 16033), row
    )
    assert torch.equal(row[0], emb[0])


# --------------------------------------------------------------------------------------------------
# Presets and the meta device


@pytest.mark.parametrize("name", sorted(PRESET_PARAMS))
def test_presets_reproduce_published_parameter_counts(name):
    model = models.build(name, device="meta")
    assert sum(p.numel() for p in model.parameters()) == PRESET_PARAMS[name]
    assert model.config.source.startswith("https://huggingface.co/")
    assert model.spec.num_layers == model.config.num_layers


def test_meta_70b_tp8_forward_under_fake_group():
    from sp_lab.distributed.collectives import fake_process_group

    with fake_process_group(8, rank=5):
        model = models.build("llama-3-70b", tp_rank=5, tp_size=8, device="meta", dtype=torch.bfloat16)
        assert model.model.layers[0].self_attn.qkv_proj.weight.shape == ((64 + 2 * 8) * 128 // 8, 8192)
        logits = model(torch.zeros(32, dtype=torch.long, device="meta"))
    assert logits.shape == (32, 128256) and logits.device.type == "meta"
    assert model.spec.num_layers == 80


def test_qwen2_has_qkv_bias_and_num_layers_override():
    model = models.build("qwen2.5-7b", num_layers=2, device="meta")
    assert model.model.layers[0].self_attn.qkv_proj.bias.shape == (3584 + 2 * 512,)
    assert len(model.model.layers) == 2 and model.spec.num_layers == 2


# --------------------------------------------------------------------------------------------------
# Dynamo capture


def test_dynamo_graph_has_attention_op_and_no_collectives_at_tp1():
    gm = _capture(models.build("toy", num_layers=3), _ids(10, 256))
    counts = _op_counts(gm)
    assert counts["sp_lab.attention"] == 3
    assert not any("_c10d_functional" in op for op in counts)


# --------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    ("overrides", "tp_size", "expected"),
    [
        ({}, 3, "vocab_size=256"),
        (
            {"vocab_size": 240, "num_heads": 6, "num_kv_heads": 2, "head_dim": 16},
            4,
            "num_heads (num_attention_heads)=6",
        ),
        ({"num_kv_heads": 2}, 4, "num_kv_heads (num_key_value_heads)=2"),
        ({"intermediate_size": 129}, 2, "intermediate_size=129"),
    ],
)
def test_tp_size_that_does_not_divide_is_refused(overrides, tp_size, expected):
    with pytest.raises(ValueError, match="tp_size values that work") as info:
        models.build("toy", tp_size=tp_size, **overrides)
    assert expected in str(info.value) and f"tp_size={tp_size}" in str(info.value)


def test_tp_sizes_that_work_divide_every_sharded_dimension_together():
    # Llama-3-8B: 32 heads, 8 kv heads, intermediate 14336, vocab 128256 -> only 1, 2, 4, 8 divide them all
    # (64 divides the MLP width and the vocabulary, not the heads).
    with pytest.raises(ValueError) as info:
        models.build("llama-3-8b", tp_size=64, device="meta")
    message = str(info.value)
    assert "num_heads (num_attention_heads)=32" in message and "num_kv_heads (num_key_value_heads)=8" in message
    assert "intermediate_size" not in message.split(";")[0]  # only the dimensions it does not divide
    assert message.endswith("tp_size values that work for this model: [1, 2, 4, 8]")
    assert models.resolve_config("llama-3-70b").tp_sizes() == [1, 2, 4, 8]
    # Each value offered really builds.
    for tp_size in models.resolve_config("toy").tp_sizes():
        models.build("toy", tp_size=tp_size, device="meta")


def test_unknown_name_and_override_are_refused():
    with pytest.raises(ValueError, match="unknown model 'llama-9b'.*llama-3-8b.*checkpoint directory"):
        models.build("llama-9b")
    with pytest.raises(ValueError, match=r"unknown model override\(s\) \['hiden_size'\].*hidden_size"):
        models.build("toy", hiden_size=8)
    with pytest.raises(ValueError, match="tp_rank=2 must lie in"):
        models.build("toy", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="input_ids must be 1-D"):
        models.build("toy")(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        models.build("toy", tp_size=2)(_ids(4, 256))
    assert TensorParallel(0, 1).shard(10, "x") == 10


def test_dtype_is_a_model_dtype_given_by_name_or_torch_dtype():
    """A dtype name builds the model a torch.dtype builds; an integer or FP8 dtype is refused at build(), naming the
    value and what works, instead of failing in torch.empty (a name) or at the first matmul (int32)."""
    by_name = models.build("toy", dtype="bfloat16")
    assert by_name.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(by_name(_ids(5, 256)), models.build("toy", dtype=torch.bfloat16)(_ids(5, 256)))
    assert models.build("toy", dtype="torch.float16", device="meta").lm_head.weight.dtype == torch.float16
    assert models.build("toy", dtype="half", device="meta").lm_head.weight.dtype == torch.float16  # torch's alias
    with pytest.raises(ValueError, match=r"dtype=torch.int32 is not a model dtype; use one of \['float32', "
                                         r"'bfloat16', 'float16'\]"):
        models.build("toy", dtype=torch.int32)
    with pytest.raises(ValueError, match="dtype='bf16' is not a model dtype"):
        models.build("toy", dtype="bf16")
    with pytest.raises(ValueError, match="quant='fp8' with dtype='bfloat16'"):
        models.build("toy", dtype=torch.float8_e4m3fn)


def test_quant_override_is_resolved_where_the_config_is():
    """resolve_config (a launched sweep's pre-check) refuses a quant typo and returns the scheme, not a string."""
    from sp_lab.models.fp8 import Fp8Scheme

    with pytest.raises(ValueError, match="quant='fp9' is not supported; use None"):
        models.resolve_config("toy", quant="fp9")
    assert models.resolve_config("toy", quant="fp8").quant == Fp8Scheme("rowwise")
    assert models.resolve_config("llama-3-8b", quant="fp8-tensorwise").quant == Fp8Scheme("tensorwise")


def test_a_checkpoint_directory_named_like_a_preset_is_never_taken_for_it(tmp_path, monkeypatch):
    """./llama-3-8b/ with a config.json beside the preset llama-3-8b: the bare name is refused (it used to give
    the preset's random weights), and './llama-3-8b' picks the directory."""
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "llama-3-8b"
    local.mkdir()
    (local / "config.json").write_text('{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, '
                                       '"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, '
                                       '"vocab_size": 256}')
    for call in (models.resolve_config, lambda name: models.build(name, device="meta")):
        with pytest.raises(ValueError, match=r"'llama-3-8b' is both a preset and a checkpoint directory here "
                                             r".*'./llama-3-8b' \(or its absolute path\) for the checkpoint directory"):
            call("llama-3-8b")
    cfg = models.resolve_config("./llama-3-8b")
    assert cfg.hidden_size == 64 and cfg.source == str(local.resolve())
    assert models.build("./llama-3-8b", device="meta").config.hidden_size == 64
    (tmp_path / "toy").mkdir()  # a directory without config.json is no checkpoint: "toy" is still the toy
    assert models.resolve_config("toy").source == "sp_lab built-in toy"


# --------------------------------------------------------------------------------------------------
# Two gloo ranks: TP logits == unsharded logits (one launch for all cases; each launch costs seconds)


def _tp2_vs_unsharded(cases: list[dict]) -> list[dict]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for kw in cases:
        ids = _ids(kw.pop("num_tokens"), 256, seed=1)
        capture = kw.pop("capture", False)
        sharded = models.build("toy", tp_rank=rank, tp_size=world, **kw)
        unsharded = models.build("toy", **kw)
        result = {"logits": sharded(ids), "reference": unsharded(ids)}
        if capture:  # one Dynamo capture is enough to count collectives (each costs seconds on 2 cores)
            result["counts"] = _op_counts(_capture(sharded, ids))
        results.append(result)
    return results


def test_tp2_gloo_logits_match_unsharded():
    cases = [
        {"num_tokens": 13},
        {"num_tokens": 16, "residual_inplace": True, "num_layers": 3, "capture": True},
        {"num_tokens": 5, "attention_bias": True, "tie_word_embeddings": True},
    ]
    per_rank = sp_lab.launch(_tp2_vs_unsharded, cases, world_size=2, backend="gloo", timeout=240)
    assert all("counts" in results[1] for results in per_rank)
    for rank_results in per_rank:
        for case, result in zip(cases, rank_results):
            torch.testing.assert_close(result["logits"], result["reference"], atol=ATOL, rtol=RTOL)
            if "counts" in result:
                layers, counts = case["num_layers"], result["counts"]
                # One all_reduce after the embedding and after each o_proj / down_proj; one logits all_gather.
                assert counts["_c10d_functional.all_reduce"] == 1 + 2 * layers
                assert counts["_c10d_functional.all_gather_into_tensor"] == 1
                assert counts["sp_lab.attention"] == layers
    torch.testing.assert_close(per_rank[0][0]["logits"], per_rank[1][0]["logits"], atol=0, rtol=0)
