"""FP8 models (``build(..., quant=...)``, compressed-tensors checkpoints) through SP and AsyncTP.

In process: every preset builds in FP8 (meta), the eager FP8 toy stays near its bf16 self, a tiny FP8
checkpoint written here with safetensors loads as written, bad quantization configs are refused.
The suite's shared launch of 2 gloo ranks (``rank_checks``) serves every numeric claim: the CPU fused scaled ops
against all_gather / reduce_scatter + ``_scaled_mm``, the compiled FP8 toy (rowwise under each working boundary
strategy, tensorwise under ``sharded``) and a plain-PyTorch FP8 stack against their eager selves, and the
checkpoint at tp 2 against tp 1.

Tolerance of compiled against eager: :data:`FP8_TOL` of the largest logit. e4m3 keeps 3 mantissa bits, so two
neighbouring FP8 values are 2^-3 = 12.5 % apart and rounding moves a value by up to 6.25 %. The compiled program
computes the bf16 activations in another order (Inductor's fused kernels, reduce_scatter instead of all_reduce),
so an activation one bf16 ulp away can round to the neighbouring FP8 value; a few such flips per row move a
logit by a few percent (measured: 3-4 %). Wrong scales, rows or chunks move it by O(100 %).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import rank_checks
import torch
import torch.distributed as dist
from tp_models import Fp8Stack

import sp_lab
import sp_lab.compiler.fused_ops
from sp_lab.models.fp8 import (
    FP8_DTYPE,
    RANDOM_INPUT_SCALE,
    quant_from_hf,
    quantize_rowwise,
    quantize_weight,
    scaled_linear,
)

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "inductor"))

TP = 2
FP8_TOL = 1 / 8  # one FP8 step of the largest logit (module docstring)
COUNTS = (12, 13)  # even, and odd (padded to a multiple of tp): both in the SP range, one compile
BOUNDARIES = ("gather_erase", "gather", "sharded")  # "none" fails by design (test_compiler_backend)
HF_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
              "mlp.up_proj", "mlp.down_proj")


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


# -- a tiny compressed-tensors FP8 checkpoint, quantised here (not by sp_lab) -----------------------------------


def fp8_config_json(cfg: Any, granularity: str) -> dict[str, Any]:
    """The config.json of ``cfg`` (a DecoderConfig) as a compressed-tensors FP8 checkpoint of ``granularity``."""
    scheme = {"weights": {"num_bits": 8, "type": "float", "strategy": granularity, "symmetric": True},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token" if granularity == "channel"
                                    else "tensor", "dynamic": granularity == "channel"}, "targets": ["Linear"]}
    return {"model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
            "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                    "config_groups": {"group_0": scheme}, "ignore": ["lm_head"]}}


def write_fp8_checkpoint(path: Path, granularity: str, *, scalar_scales: bool = False) -> Path:
    """The toy's random bf16 weights as a compressed-tensors "float-quantized" checkpoint: per linear ``weight``
    float8_e4m3fn, ``weight_scale`` ``[out, 1]`` (channel) or ``[1]`` (tensor; a 0-d scalar with
    ``scalar_scales``, as some checkpoints store it) and, tensor, ``input_scale`` (the same shape)."""
    from safetensors.torch import save_file

    model = sp_lab.models.build("toy", dtype=torch.bfloat16)
    hf = {"model.embed_tokens.weight": model.model.embed_tokens.weight, "model.norm.weight": model.model.norm.weight,
          "lm_head.weight": model.lm_head.weight}
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        full = dict(zip(HF_LINEARS, [*attn.qkv_proj.weight.split([q, kv, kv]), attn.o_proj.weight,
                                     *mlp.gate_up_proj.weight.chunk(2), mlp.down_proj.weight]))
        for name, w in full.items():
            w = w.float() * (1.5 if name.endswith("k_proj") else 1.0)  # unequal part scales: requantised on load
            one = () if scalar_scales else (1,)
            amax = w.abs().amax(-1, keepdim=True) if granularity == "channel" else w.abs().amax().reshape(one)
            scale = amax / 448.0
            prefix = f"model.layers.{i}.{name}"
            hf[f"{prefix}.weight"] = (w / scale).to(FP8_DTYPE)
            hf[f"{prefix}.weight_scale"] = scale
            if granularity == "tensor":
                hf[f"{prefix}.input_scale"] = torch.tensor(8.0 / 448.0).reshape(one)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            hf[f"model.layers.{i}.{norm}.weight"] = getattr(layer, norm).weight
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(fp8_config_json(cfg, granularity)))
    return path


# -- the one gloo launch ---------------------------------------------------------------------------------------


def _fused_scaled_ops(rank: int, group_name: str) -> dict[str, float]:
    """max |fused - unfused| / max |unfused| of both CPU fused scaled ops, rowwise and tensorwise."""
    from sp_lab.distributed.collectives import all_gather_single, reduce_scatter_single

    out = {}
    g = torch.Generator().manual_seed(100 + rank)
    b = torch.randn(24, 16, generator=torch.Generator().manual_seed(7)).to(FP8_DTYPE).t().contiguous().t()
    for kind in ("rowwise", "tensorwise"):
        b_scale = torch.rand(1, 16, generator=torch.Generator().manual_seed(8)) + 0.5
        b_scale = b_scale if kind == "rowwise" else torch.tensor(0.7)
        for rows in (1, 5):
            a = torch.randn(rows, 24, generator=g).to(FP8_DTYPE)
            a_scale = torch.rand(rows, 1, generator=g) + 0.5 if kind == "rowwise" else torch.tensor(1.3)
            gathered = torch.empty(TP * rows, 24, dtype=torch.uint8)
            all_gather_single(gathered, a.view(torch.uint8))
            scales = a_scale
            if kind == "rowwise":
                scales = torch.empty(TP * rows, 1)
                all_gather_single(scales, a_scale)
            want = torch._scaled_mm(gathered.view(FP8_DTYPE), b, scales, b_scale, out_dtype=torch.bfloat16)
            got = torch.ops.sp_lab.fused_all_gather_scaled_matmul(a, b, a_scale, b_scale, None, torch.bfloat16,
                                                                  group_name, TP)
            out[f"ag/{kind}/{rows}"] = _rel_err(got, want)
            a_full = torch.randn(TP * rows, 24, generator=g).to(FP8_DTYPE)
            full_scale = torch.rand(TP * rows, 1, generator=g) + 0.5 if kind == "rowwise" else a_scale
            partial = torch._scaled_mm(a_full, b, full_scale, b_scale, out_dtype=torch.bfloat16)
            want = torch.empty(rows, 16, dtype=torch.bfloat16)
            reduce_scatter_single(want, partial)
            got = torch.ops.sp_lab.fused_scaled_matmul_reduce_scatter(a_full, b, full_scale, b_scale, torch.bfloat16,
                                                                      group_name, TP)
            out[f"rs/{kind}/{rows}"] = _rel_err(got, want)
    return out


def _compiled_vs_eager(model: torch.nn.Module, config: sp_lab.LabConfig, inputs: dict[int, torch.Tensor]) -> dict:
    torch._dynamo.reset()
    compiled = sp_lab.compile(model, config)
    with torch.no_grad():
        errs = {n: _rel_err(compiled(x), model(x)) for n, x in inputs.items()}
    report = compiled.report
    n = next(iter(inputs))
    nodes = [node for piece in report.range_for(n).pieces if piece.graph_after for node in piece.graph_after.nodes]
    return {"errs": errs, "op_counts": dict(report.op_counts(n)), "node_dtypes": sorted({nd.dtype for nd in nodes
                                                                                          if nd.dtype}),
            "decisions": [d.dtype for piece in report.range_for(n).pieces for d in piece.async_tp_decisions]}


def _worker(checkpoints: dict[str, str]) -> dict[str, Any]:
    rank = dist.get_rank()
    results: dict[str, Any] = {"fused_ops": _fused_scaled_ops(rank, dist.group.WORLD.group_name)}
    config = {"tp_size": TP, "async_tp_min_tokens": 8, "max_num_tokens": 64}
    for quant, boundaries in (("fp8-rowwise", BOUNDARIES), ("fp8-tensorwise", ("sharded",))):
        model = sp_lab.models.build("toy", tp_rank=rank, tp_size=TP, dtype=torch.bfloat16, quant=quant)
        for boundary in boundaries:
            results[f"{quant}/{boundary}"] = _compiled_vs_eager(
                model, sp_lab.LabConfig(**config, boundary=boundary), {n: _ids(n) for n in COUNTS})
    stack = Fp8Stack(tp=TP, rank=rank)
    x = {n: torch.randn(n, 32, generator=torch.Generator().manual_seed(n)).bfloat16() for n in COUNTS}
    results["stack"] = _compiled_vs_eager(stack, sp_lab.LabConfig(**config, compile_mode="full_graph"), x)
    with torch.no_grad():
        results["checkpoints"] = {g: sp_lab.models.build(p, tp_rank=rank, tp_size=TP, dtype=torch.bfloat16)(_ids(13))
                                  for g, p in checkpoints.items()}
    return results


@functools.cache
def _written_checkpoints() -> dict[str, Path]:
    """The two FP8 checkpoints, written once (a temporary directory removed when the tests end): the ranks load
    the files the in-process tests load."""
    root = rank_checks.scratch_dir("fp8_checkpoints_")
    return {g: write_fp8_checkpoint(root / g, g) for g in ("channel", "tensor")}


rank_checks.register(__name__, _worker, prepare=lambda: ({g: str(p) for g, p in _written_checkpoints().items()},),
                     timeout=900.0)


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, Path]:
    return _written_checkpoints()


@pytest.fixture(scope="module")
def ranks(gloo_checks) -> list[dict[str, Any]]:
    return rank_checks.results_of(gloo_checks, __name__)


# -- in process ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["fp8", "fp8-tensorwise"])
@pytest.mark.parametrize("preset", sp_lab.models.available())
def test_every_preset_builds_in_fp8(preset, quant):
    model = sp_lab.models.build(preset, num_layers=1, device="meta", dtype=torch.bfloat16, quant=quant)
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert linear.weight.dtype == FP8_DTYPE
        rows = linear.weight.shape[0]
        assert linear.weight_scale.shape == ((rows, 1) if quant == "fp8" else ())
        assert (linear.input_scale is None) == (quant == "fp8")
    assert model.lm_head.weight.dtype == torch.bfloat16  # embedding and LM head stay in the model dtype
    assert model.spec.quant == ("fp8-rowwise" if quant == "fp8" else "fp8-tensorwise")


@pytest.mark.parametrize("quant", ["fp8", "fp8-tensorwise"])
def test_eager_fp8_toy_stays_near_its_high_precision_self(quant):
    ids = _ids(13)
    with torch.no_grad():
        want = sp_lab.models.build("toy", dtype=torch.float32)(ids)
        got = sp_lab.models.build("toy", dtype=torch.bfloat16, quant=quant)(ids)
    assert got.dtype == torch.bfloat16
    # Weights and activations each rounded to FP8 once per matmul (up to 6.25 % each), 8 matmuls deep.
    assert _rel_err(got, want) < 0.1


def test_all_zero_rows_quantise_to_zero_with_a_finite_scale():
    """SP pads a token count tp does not divide with all-zero rows, and quantises the padded shard per token: a zero
    row's amax is 0, and without the scale's floor it would be 0/0 (NaN) in that row."""
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    padded = torch.cat([x, x.new_zeros(2, 16)])  # as the pass pads: zero rows after the real ones
    x_fp8, scale = quantize_rowwise(padded)
    assert torch.isfinite(scale).all() and (scale > 0).all(), scale
    assert x_fp8[3:].float().eq(0).all() and not x_fp8.float().isnan().any()
    assert torch.equal((x_fp8.float() * scale)[3:], torch.zeros(2, 16))
    own_fp8, own_scale = quantize_rowwise(x)  # token-local: the real rows are as they were without the padding
    assert torch.equal(x_fp8[:3].float(), own_fp8.float()) and torch.equal(scale[:3], own_scale)


@pytest.mark.parametrize("granularity", ["rowwise", "tensorwise"])
def test_a_padded_fp8_matmul_keeps_its_zero_rows_finite(granularity):
    """Zero rows through ``scaled_linear`` (dynamic per-token scales) give the bias, and a weight channel of zeros
    (a pruned output) quantises to a finite scale too; the real rows equal the unpadded call."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 16, generator=gen)
    weight[5] = 0.0
    w_fp8, w_scale = quantize_weight(weight, granularity)
    assert torch.isfinite(w_scale).all() and (w_scale > 0).all()
    bias = torch.randn(8, generator=gen, dtype=torch.bfloat16)
    x = torch.randn(3, 16, generator=gen, dtype=torch.bfloat16)
    padded = torch.cat([x, x.new_zeros(1, 16)])
    input_scale = None if granularity == "rowwise" else torch.tensor(RANDOM_INPUT_SCALE)
    out = scaled_linear(padded, w_fp8, w_scale, input_scale, bias, torch.bfloat16)
    assert torch.isfinite(out).all(), out
    assert torch.equal(out[3], bias) and torch.equal(out[:3, 5], bias[:3].new_full((3,), bias[5].item()))
    assert torch.equal(out[:3], scaled_linear(x, w_fp8, w_scale, input_scale, bias, torch.bfloat16))


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_fp8_checkpoint_loads_as_written(checkpoints, granularity):
    from safetensors import safe_open

    model = sp_lab.models.build(checkpoints[granularity], dtype=torch.bfloat16)
    assert model.spec.quant == ("fp8-rowwise" if granularity == "channel" else "fp8-tensorwise")
    # sp_lab's linear -> the checkpoint's linears it holds, stacked
    assembled = {"self_attn.qkv_proj": HF_LINEARS[:3], "self_attn.o_proj": HF_LINEARS[3:4],
                 "mlp.gate_up_proj": HF_LINEARS[4:6], "mlp.down_proj": HF_LINEARS[6:]}
    with safe_open(str(checkpoints[granularity] / "model.safetensors"), "pt") as f:
        def dequant(layer, name):
            return f.get_tensor(f"model.layers.{layer}.{name}.weight").float() * f.get_tensor(
                f"model.layers.{layer}.{name}.weight_scale").float().reshape(-1, 1)
        for i, layer in enumerate(model.model.layers):
            for path, names in assembled.items():
                linear = layer.get_submodule(path)
                want = torch.cat([dequant(i, n) for n in names])
                got = linear.weight.float() * linear.weight_scale.float().reshape(-1, 1)
                if granularity == "channel" or len(names) == 1:  # bytes and scales as stored
                    assert torch.equal(got, want), (i, path)
                else:  # parts requantised with the largest of their scales: within one FP8 step of each weight
                    assert linear.weight_scale.dim() == 0 and linear.input_scale.dim() == 0
                    assert ((got - want).abs() <= want.abs() / 8 + 1e-6).all(), (i, path)
    assert len(model.model.layers) == 2
    with torch.no_grad():
        logits = model(_ids(13))
    assert torch.isfinite(logits).all()


def test_scalar_tensorwise_scales_load_as_one_element_scales(checkpoints, tmp_path):
    """Checkpoints in the wild store a tensorwise weight_scale / input_scale as [1] or as a 0-d scalar: the same
    values either way, so the same model."""
    scalar = write_fp8_checkpoint(tmp_path / "scalar", "tensor", scalar_scales=True)
    from safetensors import safe_open

    with safe_open(str(scalar / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight_scale").get_shape() == []
    ids = _ids(13)
    with torch.no_grad():
        got = sp_lab.models.build(scalar, dtype=torch.bfloat16)(ids)
        want = sp_lab.models.build(checkpoints["tensor"], dtype=torch.bfloat16)(ids)
    assert torch.equal(got, want)


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_fp8_checkpoint_config_alone_builds_on_meta(tmp_path, granularity):
    """device="meta" reads config.json only (no weights): a tensorwise checkpoint's per-part scales are fused on
    meta tensors too (repeat_interleave needs its output size there), e.g. to trace a 70B FP8 model."""
    (tmp_path / "config.json").write_text(json.dumps(fp8_config_json(sp_lab.models.resolve_config("toy"), granularity)))
    model = sp_lab.models.build(tmp_path, device="meta", dtype=torch.bfloat16)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.is_meta and qkv.weight.dtype == FP8_DTYPE
    assert qkv.weight_scale.shape == ((qkv.weight.shape[0], 1) if granularity == "channel" else ())
    assert model.spec.quant == ("fp8-rowwise" if granularity == "channel" else "fp8-tensorwise")


@pytest.mark.parametrize(("qc", "message"), [
    ({"quant_method": "gptq"}, "quant_method='gptq' is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"strategy": "block"},
                                                                   "input_activations": {"dynamic": True}}}},
     "strategy 'block'"),
])
def test_unsupported_quantization_configs_are_refused_by_name(qc, message):
    with pytest.raises(ValueError, match=message):
        quant_from_hf({"quantization_config": qc})


def test_unknown_quant_is_refused_by_name():
    with pytest.raises(ValueError, match="quant='int4' is not supported; use None"):
        sp_lab.models.build("toy", quant="int4")


# -- 2 gloo ranks ----------------------------------------------------------------------------------------------


def test_cpu_fused_scaled_ops_equal_collective_then_scaled_mm(ranks):
    for result in ranks:
        # Same rows, same scales, same kernel per chunk: only the bf16 sum of the reduce may round differently.
        assert all(err <= 2**-7 for err in result["fused_ops"].values()), result["fused_ops"]


@pytest.mark.parametrize("case", [*(f"fp8-rowwise/{b}" for b in BOUNDARIES), "fp8-tensorwise/sharded", "stack"])
def test_compiled_fp8_model_matches_eager_with_every_scaled_matmul_fused(ranks, case):
    for result in ranks:
        got = result[case]
        assert all(err < FP8_TOL for err in got["errs"].values()), got["errs"]
        counts = got["op_counts"]
        assert counts["all_reduce"] == 0 and counts["mm"] == (1 if case == "stack" else 0), counts
        assert counts["fused_all_gather_matmul"] + counts["fused_matmul_reduce_scatter"] > 0, counts
        assert "float8_e4m3fn" in got["decisions"] and "float8_e4m3fn" in got["node_dtypes"]


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_fp8_checkpoint_at_tp2_matches_tp1(ranks, checkpoints, granularity):
    with torch.no_grad():
        want = sp_lab.models.build(checkpoints[granularity], dtype=torch.bfloat16)(_ids(13))
    for result in ranks:
        # tp 2 sums two bf16 partial products where tp 1 sums in one matmul: bf16 rounding, then FP8 flips.
        assert _rel_err(result["checkpoints"][granularity], want) < FP8_TOL


# -- tuning knows the dtype ----------------------------------------------------------------------------------


def _synthetic_rows(dtype: str, crossover: int) -> list[dict]:
    """Microbenchmark-shaped rows where fusing pays from ``crossover`` tokens on, for 12 shapes."""
    rows = []
    for n, k in ((n, k) for n in (1024, 2048, 4096, 8192) for k in (1024, 4096, 8192)):
        for m in (2**i for i in range(4, 15)):
            unfused = 10.0 + m * n * k / 1e9
            rows.append({"m": m, "n": n, "k": k, "tp": 4, "dtype": dtype, "unfused_us": unfused,
                         "fused_us": unfused * (0.8 if m >= crossover else 1.3)})
    return rows


def test_rule_training_refuses_pooled_bf16_and_fp8_rows_and_learns_both_with_the_dtype_feature():
    pl = pytest.importorskip("polars")
    from sp_lab.tuning.train import DEFAULT_FEATURES, train_rule

    rows = pl.DataFrame(_synthetic_rows("bfloat16", 256) + _synthetic_rows("fp8-rowwise", 2048))
    with pytest.raises(ValueError, match=r"rows mix matmul dtypes \['bfloat16', 'fp8-rowwise'\]"):
        train_rule(rows)
    rule = train_rule(rows, feature_names=(*DEFAULT_FEATURES, "dtype_bytes"), min_samples_leaf=1,
                      val_fraction=0.2, test_fraction=0.2).rule
    # The same matmul at 512 tokens: past the bf16 crossover, short of the FP8 one.
    assert rule.decide(512, 4096, 1024, 4, dtype_bytes=2) == "fuse"
    assert rule.decide(512, 4096, 1024, 4, dtype_bytes=1) == "no_fuse"


def test_policy_refuses_rows_pooling_bf16_and_fp8_sweeps():
    pytest.importorskip("polars")
    from sp_lab.tuning.policy import recommend

    rows = [{"num_tokens": t, "variant": v, "latency_us": 100.0 + t, "dtype": dtype, "source": "measured"}
            for dtype in ("bfloat16", "fp8-rowwise") for t in (16, 64) for v in ("baseline", "sp+async_tp")]
    with pytest.raises(ValueError, match=r"rows of 2 setups \(setup=\{'dtype': '(fp8-rowwise|bfloat16)'\} \(4 rows\); "
                       r"setup=\{'dtype': '(bfloat16|fp8-rowwise)'\} \(4 rows\)\): a policy is made for one setup"):
        recommend(rows, sp_lab.LabConfig(tp_size=2))
