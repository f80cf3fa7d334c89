"""What an exported tuned-config file carries beside it and says, where the other export tests do not reach: a
model whose vLLM release gates its own SP by tokens (the patch written beside the file), and a serving section as
an older or hand-edited file may hold it."""

import json

import polars as pl

from sp_lab.config import LabConfig
from sp_lab.tuning.export import describe_file, export_config, patch_path, serving_line

TUNED = 256  # whole batch at tp 4: 64 rows per rank
CONFIG = LabConfig(tp_size=4, async_tp_min_tokens=TUNED, max_num_tokens=8192)


def _sweep_rows(model: str, dtype: str = "bfloat16") -> pl.DataFrame:
    """A layer sweep on GPUs where sp+async_tp is fastest from ``TUNED`` tokens on (the rest: baseline)."""
    rows = []
    for t in (64, 128, TUNED, 1024, 4096):
        for variant, base in (("baseline", 100.0), ("sp", 105.0), ("sp+async_tp", 110.0)):
            faster = variant == "sp+async_tp" and t >= TUNED
            rows.append({"num_tokens": t, "variant": variant, "latency_us": 80.0 if faster else base,
                         "source": "measured", "tp": 4, "model": model, "dtype": dtype, "hidden_size": 8192,
                         "num_layers": 80, "device_name": "NVIDIA H200", "torch_version": "2.11.0", "backend": "nccl"})
    return pl.DataFrame(rows)


def _matmul_rows() -> pl.DataFrame:
    """Per-matmul timings at tp 4 where each matmul's fused form pays from its own count: gate_up (all-gather side,
    listed first) from 256 tokens, qkv (all-gather) from 2048 (512 rows per rank), o_proj (reduce-scatter) from 64."""
    wins_from = {"gate_up": ("ag", 8192, 7168, 256), "qkv": ("ag", 8192, 2560, 2048), "o_proj": ("rs", 2048, 8192, 64)}
    rows = []
    for name, (side, k, n, start) in wins_from.items():
        for m in (16, 64, 256, 2048, 8192):
            unfused = 100.0 + m
            rows.append({"name": name, "side": side, "k": k, "n": n, "dtype": "bfloat16", "tp": 4, "m": m,
                         "unfused_us": unfused, "fused_us": unfused * (0.8 if m >= start else 1.3),
                         "device": "NVIDIA H200", "torch": "2.11.0", "source": "measured"})
    return pl.DataFrame(rows)


def _muse_spark_checkpoint(tmp_path):
    checkpoint = tmp_path / "muse-spark"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["MuseSparkForConditionalGeneration"]}))
    return str(checkpoint)


def test_a_token_gated_model_gets_the_edit_with_the_tuned_gate_and_qkvs_fused_gate(tmp_path):
    """vLLM 0.34's Muse Spark gates SP by tokens: the file's model-level section and the patch beside it set the
    SP gate to the tuned count (whole batch) and the fused all-gather + matmul's constant to qkv's gate per rank
    (not another all-gather matmul's, not the layer's)."""
    rows = _sweep_rows(_muse_spark_checkpoint(tmp_path))
    path = export_config(rows, CONFIG, tmp_path / "out", chosen_in="test", vllm_release="0.34",
                         matmul_rows=_matmul_rows())
    level = json.loads(path.read_text())["model_sp"]["vllm"]
    assert (level["release"], level["has_sp"], level["token_gated"]) == ("0.34.0", True, True)
    assert level["architecture"] == "MuseSparkForConditionalGeneration"
    assert "and the fused all-gather + matmul's per-rank gate" in level["statement"]
    patch = patch_path(path, "0.34.0").read_text()
    assert patch == level["patch"]
    assert "+_FUSED_AG_MATMUL_MIN_TOKENS_PER_RANK = 512" in patch.splitlines()  # qkv: 2048 tokens / tp 4
    assert "+        self.sp_min_tokens = 256" in patch.splitlines()  # the literal 0 assignment, whole batch
    text = describe_file(path)
    assert f"the edit: {patch_path(path, '0.34.0').name} (in site-packages: patch -p1 < it" in text
    assert "the patch sets it to 256 wherever the model assigns it" in text


def test_an_fp8_model_keeps_vllms_fused_gate_which_fuses_bf16_only(tmp_path):
    """vLLM fuses the all-gather + matmul for bf16 only: an FP8 layer's edit sets the SP gate, not the constant."""
    rows = _sweep_rows(_muse_spark_checkpoint(tmp_path), dtype="fp8-rowwise")
    path = export_config(rows, CONFIG, tmp_path / "out", chosen_in="test", vllm_release="0.34",
                         matmul_rows=_matmul_rows())
    patch = patch_path(path, "0.34.0").read_text()
    assert "_FUSED_AG_MATMUL_MIN_TOKENS_PER_RANK" not in patch and "self.sp_min_tokens = 256" in patch


def test_a_serving_section_without_its_workload_still_reads_as_a_line():
    """A section written by hand or by an older sp_lab may lack the workload: the line says "?" rather than None."""
    assert serving_line({"source": "measured", "not_priced": "no decode rows"}) == (
        "serving (? traffic, measured rows): not priced: no decode rows")
    line = serving_line({"sentence": "sp+async_tp from 64: pays.", "scheduler": {"max_num_batched_tokens": 256}})
    assert line == "serving (? traffic, budget 256 tokens): sp+async_tp from 64: pays."
