"""Loading Hugging Face safetensors checkpoints: parity with transformers at tp 1 and 2, sharded
checkpoints, per-rank slicing, and the errors for missing/mismatched tensors and pickle files.

The checkpoints are tiny random models made with transformers and saved locally (no downloads).
Tolerance against transformers' logits (float32): atol 1e-5, rtol 1e-4.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import sp_lab
from sp_lab import models
from sp_lab.models import CheckpointError, DecoderConfig
from sp_lab.models.checkpoint import SafetensorsWeights

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

ATOL, RTOL = 1e-5, 1e-4
SHAPES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}
# Llama-3.1-style frequency scaling with a short original context so it changes most frequencies.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _make_hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            **SHAPES,
            rope_theta=10000.0,
            rope_scaling=dict(LLAMA3_ROPE),  # a copy: transformers 5 writes rope_theta into the dict it gets
            max_position_embeddings=128,
            rms_norm_eps=1e-5,
        )
        model = transformers.LlamaForCausalLM(config)
    else:  # qwen2: q/k/v biases, tied embeddings, default RoPE
        config = transformers.Qwen2Config(**SHAPES, tie_word_embeddings=True, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0; perturb so loading them is tested
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor, torch.Tensor]]:
    """kind -> (checkpoint dir, input_ids [T], transformers' logits [T, vocab])."""
    out = {}
    ids = torch.randint(0, SHAPES["vocab_size"], (40,), generator=torch.Generator().manual_seed(7))
    for kind in ("llama", "qwen2"):
        model = _make_hf_model(kind)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path, safe_serialization=True)
        with torch.no_grad():
            out[kind] = (path, ids, model(ids[None]).logits[0])
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tp1_matches_transformers(checkpoints, kind):
    path, ids, expected = checkpoints[kind]
    model = models.build(str(path))
    assert model.config.model_type == kind and model.spec.vocab_size == SHAPES["vocab_size"]
    torch.testing.assert_close(model(ids), expected, atol=ATOL, rtol=RTOL)


def _tp_logits(paths: list[str], ids: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist

    return [models.build(p, tp_rank=dist.get_rank(), tp_size=dist.get_world_size())(ids) for p in paths]


def test_tp2_matches_transformers(checkpoints):
    kinds = ["llama", "qwen2"]
    ids = checkpoints["llama"][1]
    per_rank = sp_lab.launch(
        _tp_logits, [str(checkpoints[k][0]) for k in kinds], ids, world_size=2, backend="gloo", timeout=240
    )
    for rank_logits in per_rank:
        for kind, logits in zip(kinds, rank_logits):
            torch.testing.assert_close(logits, checkpoints[kind][2], atol=ATOL, rtol=RTOL)


def test_each_rank_reads_only_its_slices(checkpoints, monkeypatch):
    path = checkpoints["llama"][0]
    reads = []
    original = SafetensorsWeights.read

    def spy(self, piece):
        value = original(self, piece)
        reads.append((piece, tuple(value.shape)))
        return value

    monkeypatch.setattr(SafetensorsWeights, "read", spy)
    models.build(str(path), tp_rank=1, tp_size=2)
    by_name = {piece.name: (piece, shape) for piece, shape in reads}
    q, q_shape = by_name["model.layers.0.self_attn.q_proj.weight"]
    assert (q.dim, q.start, q.stop, q_shape) == (0, 32, 64, (32, 64))
    o, o_shape = by_name["model.layers.1.self_attn.o_proj.weight"]
    assert (o.dim, o.start, o.stop, o_shape) == (1, 32, 64, (64, 32))
    assert by_name["lm_head.weight"][1] == (64, 64)
    # Only 1-D norm weights are read whole; every matrix read is half of the full tensor.
    for piece, shape in reads:
        assert len(shape) == 1 or shape[0] * shape[1] * 2 == piece.full_shape[0] * piece.full_shape[1], piece


def test_sharded_checkpoint_with_index(checkpoints, tmp_path):
    _, ids, expected = checkpoints["llama"]
    _make_hf_model("llama").save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    torch.testing.assert_close(models.build(str(tmp_path))(ids), expected, atol=ATOL, rtol=RTOL)


def test_num_layers_override_loads_the_first_layers(checkpoints):
    path, ids, _ = checkpoints["llama"]
    hf = _make_hf_model("llama")
    hf.model.layers = hf.model.layers[:1]
    hf.config.num_hidden_layers = 1
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    model = models.build(str(path), num_layers=1)
    assert model.spec.num_layers == 1
    torch.testing.assert_close(model(ids), expected, atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------------------------------
# Bad checkpoints


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_is_named(checkpoints, tmp_path):
    path = _copy(checkpoints["llama"][0], tmp_path / "ckpt")
    tensors = safetensors_torch.load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors_torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' \(expected shape \[128, 64\]\)"
    ):
        models.build(str(path))


def test_shape_mismatch_is_named(checkpoints, tmp_path):
    path = _copy(checkpoints["llama"][0], tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        models.build(str(path))
    message = str(info.value)
    assert (
        "'model.layers.0.mlp.gate_proj.weight' in model.safetensors has shape [128, 64], expected [96, 64]"
        in message
    )
    assert "down_proj" in message  # every problem is listed, not just the first


def test_pickle_checkpoint_is_refused(checkpoints, tmp_path):
    path = tmp_path / "pickled"
    path.mkdir()
    shutil.copy(checkpoints["llama"][0] / "config.json", path)
    torch.save({"model.embed_tokens.weight": torch.zeros(128, 64)}, path / "pytorch_model.bin")
    with pytest.raises(
        CheckpointError, match=r"only pickle checkpoint file\(s\) \['pytorch_model.bin'\].*safetensors"
    ):
        models.build(str(path))


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="without config.json"):
        models.build(str(tmp_path))


# --------------------------------------------------------------------------------------------------
# config.json forms


def test_rope_config_forms_agree():
    v4 = {"rope_theta": 5e5, "rope_scaling": {**LLAMA3_ROPE}}
    v5 = {"rope_parameters": {"rope_theta": 5e5, **LLAMA3_ROPE}}
    a, b = (DecoderConfig.from_hf({**SHAPES, "model_type": "llama", **form}, name="x") for form in (v4, v5))
    assert a == b and a.rope_theta == 5e5 and a.rope_scaling["rope_type"] == "llama3"
    with pytest.raises(
        ValueError, match=r"rope_scaling type 'yarn' is not supported; supported: \['default', 'llama3'\]"
    ):
        DecoderConfig.from_hf({**SHAPES, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, name="x")
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        DecoderConfig.from_hf({**SHAPES, "model_type": "gpt2"}, name="x")
