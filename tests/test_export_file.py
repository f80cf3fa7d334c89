"""What an exported tuned-config file carries beside it and says, where the other export tests do not reach: a
model whose vLLM release gates its own SP by tokens (the patch written beside the file), and a serving section as
an older or hand-edited file may hold it."""

import json
import re

import polars as pl
import pytest

from sp_lab.bench.store import data_hash
from sp_lab.config import LabConfig
from sp_lab.tuning.export import describe_file, export_config, export_tuned_config, patch_path, serving_line

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


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()]


def test_the_description_says_policy_regret_machine_release_gates_and_next_step_line_by_line(tmp_path):
    """Every line describe_file writes for a GPU export to vLLM 0.31, as a person reads it: the policy and its regret
    on the rows, the machine (device, backend, model, tp, dtype, torch, rows), the release and why it was chosen, the
    serve line, the model-code gates with the file they are in, torch.compile's settings and snippet, the next step."""
    rows = _sweep_rows("llama-3-70b")
    path = export_config(rows, CONFIG, tmp_path, chosen_in="test", vllm_release="0.31")
    stem = path.stem
    lines = _lines(describe_file(path))
    assert lines[0] == f"tuned config -> {path}"
    assert lines[1] == "policy: baseline below 256, sp+async_tp from 256; regret on the 15 measured rows: worst 0.0%, total 0.0%"
    # which torch the file names (the exporter's, not the rows' torch_version) is left open here
    assert lines[2].startswith("tuned on: NVIDIA H200 (nccl), llama-3-70b, tp 4, bfloat16, torch ")
    assert lines[2].endswith(f", rows {data_hash(rows)}")
    assert lines[3].startswith("vLLM 0.31.0 (chosen): In vLLM 0.31.0 this runs SP + AsyncTP from 256 tokens")
    assert lines[4].startswith("vllm serve meta-llama/Meta-Llama-3-70B --tensor-parallel-size 4")
    assert lines[5] == ("model code (hand-written SP): SP pays per layer from 64 tokens per rank (256 of the whole batch); "
                        "per matmul: min_tokens_per_rank(k, n, dtype, tp) and min_tokens(...) (whole batch) in "
                        f"{stem}.min_tokens_per_rank.py")
    assert lines[6] == ("torch.compile: micro-pipeline TP needs torch._inductor.config._micro_pipeline_tp = True and "
                        "enable_symm_mem_for_group(group_name) on the TP group, and has no token gate of its own; "
                        f"{stem}.torch_compile.py fuses from 256 tokens of the whole batch (two compiled programs, "
                        "picked per call)")
    assert lines[7:] == ["next: serve with the line above and compare throughput with the same line for 'never'"]


def test_a_policy_the_release_cannot_run_names_the_closest_choice_with_its_regret(tmp_path):
    """The newest release (the default) cannot run a token gate: the description says it is the newest known, lists
    the closest choice it can run with that choice's regret on the rows (never: 20 us of 80 lost at each of the three
    sizes where sp+async_tp was faster), and serves that choice."""
    path = export_config(_sweep_rows("llama-3-70b"), CONFIG, tmp_path, chosen_in="test")
    lines = _lines(describe_file(path))
    assert lines[3].startswith("vLLM 0.34.0 (newest known): vLLM 0.34.0 cannot run this policy")
    assert lines[4] == "closest it can run: never (worst 25.0%, total 75.0%)"
    assert lines[5] == "vllm serve meta-llama/Meta-Llama-3-70B --tensor-parallel-size 4"
    assert lines[7].startswith("vLLM 0.34.0: vLLM 0.34.0 has no SP for LlamaForCausalLM")
    regret = json.loads(path.read_text())["vllm"]["closest"]["never"]["regret"]
    assert regret == {"worst": pytest.approx(0.25), "total": pytest.approx(0.75)}
    assert lines[-1].startswith("next: the line above is the 'never' line itself")  # nothing to compare it with


def test_a_policy_that_never_fuses_says_so_in_each_target(tmp_path):
    never = LabConfig(tp_size=4, enable_sp=False, enable_async_tp=False, max_num_tokens=8192)
    path = export_config(_sweep_rows("llama-3-70b"), never, tmp_path, chosen_in="test", vllm_release="0.31")
    lines = _lines(describe_file(path))
    assert lines[1] == ("policy: baseline everywhere (SP and AsyncTP never); regret on the 15 measured rows: "
                        "worst 25.0%, total 75.0%")
    assert lines[5].startswith("model code (hand-written SP): SP never paid per layer; per matmul:")
    assert lines[6].endswith(f"; the policy never fuses: {path.stem}.torch_compile.py compiles without it")
    assert lines[-1] == ("next: the line above is the 'never' line itself, so there is no other line to compare it "
                         "with; tune again if the model, the GPUs or the batch sizes change")
    # a file written before the snippet existed: how to apply the gate from sp_lab itself
    doc = json.loads(path.read_text())
    del doc["torch_compile"]
    path.write_text(json.dumps(doc))
    assert _lines(describe_file(path))[6].endswith(
        "; sp_lab.compile(model, sp_lab.LabConfig.from_json(path)) applies this gate")


def test_the_files_provenance_is_the_rows_and_the_choice(tmp_path):
    rows = _sweep_rows("llama-3-70b")
    path = export_config(rows, CONFIG, tmp_path, chosen_in="the tuner", vllm_release="0.31")
    prov = json.loads(path.read_text())["provenance"]
    created = prov.pop("created_utc")
    assert prov.pop("torch") == "2.11.0"  # the rows' torch_version, not the exporting process's
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", created)
    per_token = {str(t): {"ran": "sp+async_tp" if t >= TUNED else "baseline",
                          "best": "sp+async_tp" if t >= TUNED else "baseline", "regret_rel": 0.0}
                 for t in (64, 128, TUNED, 1024, 4096)}
    assert prov == {
        "device": "NVIDIA H200", "tp_size": 4, "dtype": "bfloat16",
        "model": {"name": "llama-3-70b", "hidden_size": 8192, "num_layers": 80,
                  "vllm_model": "meta-llama/Meta-Llama-3-70B", "architecture": "LlamaForCausalLM"},
        "data_hash": data_hash(rows), "source": "measured", "sweep_rows": 15, "backend": "nccl", "boundary": None,
        "chosen_in": "the tuner", "policy": "baseline below 256, sp+async_tp from 256", "async_tp_min_tokens": "256",
        "regret": {"worst": 0.0, "total": 0.0, "per_token": per_token}}


@pytest.mark.parametrize(("changes", "why"), [
    ({"source": "predicted"}, "predicted rows (a model of the GPUs, not a run on them): no GPU measured this policy"),
    ({"backend": "gloo"}, "gloo on CPU: collectives do not overlap with matmuls there"),
    ({"device_name": "CPU (AMD EPYC)"}, "gloo on CPU: collectives do not overlap with matmuls there"),
])
def test_rows_that_cannot_answer_for_gpus_are_warned_about(tmp_path, changes, why):
    rows = _sweep_rows("llama-3-70b").with_columns(**{k: pl.lit(v) for k, v in changes.items()})
    path = export_config(rows, CONFIG, tmp_path, chosen_in="test", vllm_release="0.31", allow_predicted=True)
    lines = _lines(describe_file(path))
    assert lines[3].startswith(f"WARNING: tuned on {why}")
    assert lines[-1] == ("next: measure on the GPUs you serve on: torchrun --nproc-per-node 4 -m sp_lab run "
                         "--model llama-3-70b --tp 4 --dtype bfloat16")


def test_the_release_is_said_to_be_the_installed_one_only_when_it_is(tmp_path, monkeypatch):
    import sp_lab.tuning.export as E

    path = export_config(_sweep_rows("llama-3-70b"), CONFIG, tmp_path, chosen_in="test", vllm_release="0.31")
    monkeypatch.setattr(E, "installed_table_release", lambda: "0.31.0")
    assert _lines(describe_file(path))[3].startswith("vLLM 0.31.0 (installed here): ")

    def unplaceable():
        raise KeyError("vLLM 0.9.0 is older than every release in the table")

    monkeypatch.setattr(E, "installed_table_release", unplaceable)  # an installed vLLM the table cannot place
    assert _lines(describe_file(path))[3].startswith("vLLM 0.31.0 (chosen): ")


def test_a_file_written_without_rows_says_what_it_does_not_know(tmp_path):
    """export_tuned_config without the rows' provenance (a config written by hand or by an older sp_lab): no regret,
    no row count, no model-level section; the description says so instead of failing."""
    path = export_tuned_config(CONFIG, directory=tmp_path, device_name="NVIDIA H200",
                               model_spec={"name": "llama-3-70b"}, dtype="bfloat16", data_hash="abc",
                               vllm_release="0.31.0")
    lines = _lines(describe_file(path))
    assert lines[1] == "policy: baseline below 256, sp+async_tp from 256; regret on the ? rows: worst n/a, total n/a"
    assert lines[2].startswith("tuned on: NVIDIA H200, llama-3-70b, tp 4, bfloat16, torch ")
    assert not [line for line in lines if line.startswith("model code")]


def test_a_token_gated_model_whose_matmuls_are_unknown_gets_the_sp_gate_alone(tmp_path):
    """Without per-matmul rows and with a checkpoint sp_lab cannot read the shapes of, there is no qkv gate: the edit
    sets the SP gate and leaves vLLM's fused all-gather + matmul constant as it is."""
    path = export_config(_sweep_rows(_muse_spark_checkpoint(tmp_path)), CONFIG, tmp_path / "out", chosen_in="test",
                         vllm_release="0.34")
    assert json.loads(path.read_text())["model_sp"]["matmuls"] == []
    patch = patch_path(path, "0.34.0").read_text()
    assert "self.sp_min_tokens = 256" in patch and "_FUSED_AG_MATMUL_MIN_TOKENS_PER_RANK" not in patch
