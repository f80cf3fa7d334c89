"""describe_file, line by line, for the files the other export tests do not describe whole: CPU rows with a serving
section and no model vLLM can load, a release with two closest choices, a release build the table reads as another,
and files written by hand or by an older sp_lab (fields missing or changed)."""

import json
import re

import polars as pl
import pytest
from test_cli import curve_rows
from test_export_file import CONFIG, _lines, _sweep_rows

from sp_lab.bench.store import data_hash
from sp_lab.config import ConfigError, LabConfig
from sp_lab.programs import Policy
from sp_lab.serving.on_rows import serving_answer
from sp_lab.tuning.export import describe_file, export_config, serving_line

TORCH_COMPILE = ("torch.compile: micro-pipeline TP needs torch._inductor.config._micro_pipeline_tp = True and "
                 "enable_symm_mem_for_group(group_name) on the TP group, and has no token gate of its own; ")


def test_cpu_rows_of_sp_labs_own_model_with_a_serving_section(tmp_path):
    """Toy rows measured with gloo on CPU, exported with their serving answer for the newest release: a warning,
    the closest choice, no serve line but the flags it would carry, the serving sentence with this config's speedup,
    and a next step that says to measure on GPUs."""
    rows = pl.DataFrame(curve_rows())
    config = Policy.gate("baseline", "sp+async_tp", 64).to_config(LabConfig(tp_size=2))
    path = export_config(rows, config, tmp_path, chosen_in="test", traffic=serving_answer(rows, config=config))
    stem = path.stem
    lines = _lines(describe_file(path))
    assert lines[1] == "policy: baseline below 64, sp+async_tp from 64; regret on the 15 measured rows: worst 0.0%, total 0.0%"
    assert lines[2].startswith("tuned on: cpu: test (gloo), toy, tp 2, float32, torch ")
    assert lines[2].endswith(f", rows {data_hash(rows)}")
    assert lines[3] == ("WARNING: tuned on gloo on CPU: collectives do not overlap with matmuls there and the fused "
                        "kernels are sp_lab's chunked CPU stand-ins, so this says nothing about GPUs.")
    assert lines[4].startswith("vLLM 0.34.0 (newest known): vLLM 0.34.0 cannot run this policy: ")
    assert lines[5] == "closest it can run: never (worst 25.0%, total 50.0%)"
    assert lines[6] == ("no vllm serve line: toy is sp_lab's own model, which vLLM cannot load: tune a preset or your "
                        "checkpoint for a serve line; its flags for a model of this shape: --tensor-parallel-size 2")
    assert lines[7] == ("model code (hand-written SP): SP pays per layer from 32 tokens per rank (64 of the whole "
                        "batch); per matmul: min_tokens_per_rank(k, n, dtype, tp) and min_tokens(...) (whole batch) in "
                        f"{stem}.min_tokens_per_rank.py")
    assert lines[8].startswith("serving (chat traffic, budget 256 tokens): sp+async_tp from 64: pays on this traffic, ")
    assert lines[8].endswith(" from measured rows; 28% of baseline's step time is in steps under 64 tokens, where the "
                             "policy runs baseline; the most time goes to steps of 64-127 tokens (48%). This config: "
                             "1.17x vs baseline.")
    assert lines[9] == (f"{TORCH_COMPILE}{stem}.torch_compile.py fuses from 64 tokens of the whole batch (two compiled "
                        "programs, picked per call)")
    assert lines[10:] == [("next: measure on the GPUs you serve on: torchrun --nproc-per-node 2 -m sp_lab run "
                           "--model toy --tp 2 --dtype bfloat16")]


def test_a_serving_line_names_its_workload_and_this_configs_speedup():
    section = {"workload": "lmsys-chat", "source": "measured", "sentence": "sp from 64: pays.",
               "scheduler": {"max_num_batched_tokens": 512}, "this_config": {"speedup_vs_baseline": 1.234}}
    assert serving_line(section) == ("serving (lmsys-chat traffic, budget 512 tokens): sp from 64: pays. "
                                     "This config: 1.23x vs baseline.")
    assert serving_line({"workload": "chat", "source": "replayed", "not_priced": "no decode rows"}) == (
        "serving (chat traffic, replayed rows): not priced: no decode rows")


def test_a_release_with_two_closest_choices_serves_the_one_with_less_regret(tmp_path):
    """vLLM 0.15 runs SP at every token count or not at all: 'always' loses 10% at 64 and 128 tokens (20% in all),
    'never' 25% at each of the three sizes from 256 (75%); the serve line is always's, and the next step compares
    it with never's."""
    rows = _sweep_rows("llama-3-70b")
    path = export_config(rows, CONFIG, tmp_path, chosen_in="test", vllm_release="0.15")
    lines = _lines(describe_file(path))
    assert lines[2] == f"tuned on: NVIDIA H200 (nccl), llama-3-70b, tp 4, bfloat16, torch 2.11.0, rows {data_hash(rows)}"
    assert lines[3].startswith("vLLM 0.15.1 (chosen): vLLM 0.15.1 cannot run this policy: vLLM 0.15.1 has no token "
                               "gate for SP")
    assert lines[4:6] == ["closest it can run: never (worst 25.0%, total 75.0%)",
                          "closest it can run: always (worst 10.0%, total 20.0%)"]
    assert lines[6] == ("vllm serve meta-llama/Meta-Llama-3-70B --tensor-parallel-size 4 --compilation-config "
                        """'{"mode":3,"pass_config":{"enable_sp":true,"fuse_gemm_comms":true},"splitting_ops":[],"""
                        """"cudagraph_mode":"NONE"}'""")
    assert lines[-1] == "next: serve with the line above and compare throughput with the same line for 'never'"


def test_a_release_build_the_table_lacks_is_noted(tmp_path):
    path = export_config(_sweep_rows("llama-3-70b"), CONFIG, tmp_path, chosen_in="test", vllm_release="0.31.5")
    lines = _lines(describe_file(path))
    assert lines[3].startswith("vLLM 0.31.0 (chosen): In vLLM 0.31.0 this runs SP + AsyncTP from 256 tokens")
    assert lines[4] == "note: vLLM 0.31.5 is not in the release table: read as 0.31.0, the table's 0.31 release"
    assert lines[5].startswith("vllm serve meta-llama/Meta-Llama-3-70B --tensor-parallel-size 4 "
                               "--max-num-batched-tokens 8192 --compilation-config ")


def test_the_edit_line_names_the_patch_and_the_wheel_it_was_read_from(tmp_path):
    checkpoint = tmp_path / "muse-spark"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["MuseSparkForConditionalGeneration"]}))
    path = export_config(_sweep_rows(str(checkpoint)), CONFIG, tmp_path / "out", chosen_in="test", vllm_release="0.34")
    wheel = json.loads(path.read_text())["model_sp"]["vllm"]["wheel"]
    assert wheel.startswith("vllm-0.34.0-") and wheel.endswith(".whl")
    assert f"the edit: {path.stem}.vllm-0.34.0.patch (in site-packages: patch -p1 < it; read from {wheel})" in _lines(
        describe_file(path))


def _edited(tmp_path, edit, *, release="0.31"):
    """A file as an older sp_lab or a person may have left it: the exported file with ``edit`` applied."""
    path = export_config(_sweep_rows("llama-3-70b"), CONFIG, tmp_path, chosen_in="test", vllm_release=release)
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    return path


def test_a_file_without_its_model_says_MODEL_where_the_model_goes(tmp_path):
    path = _edited(tmp_path, lambda doc: doc["provenance"].pop("model"))
    lines = _lines(describe_file(path))
    assert lines[2].startswith("tuned on: NVIDIA H200 (nccl), MODEL, tp 4, bfloat16, torch 2.11.0, rows ")
    assert lines[4].startswith("vllm serve MODEL --tensor-parallel-size 4 --max-num-batched-tokens 8192 ")


def test_the_serve_line_loads_what_the_file_names(tmp_path):
    """A file whose model is served from another id (a fine-tune, a mirror) keeps that id on its serve line."""
    path = _edited(tmp_path, lambda doc: doc["provenance"]["model"].update(vllm_model="acme/llama-70b-ft"))
    assert _lines(describe_file(path))[4].startswith("vllm serve acme/llama-70b-ft --tensor-parallel-size 4 ")
    assert _lines(describe_file(path, model="/ckpt/x"))[4].startswith("vllm serve /ckpt/x --tensor-parallel-size 4 ")


def test_what_the_release_does_is_the_files_text_else_the_tables(tmp_path):
    path = _edited(tmp_path, lambda doc: doc["vllm"].update(does="As written by an older sp_lab."))
    assert _lines(describe_file(path))[3] == "vLLM 0.31.0 (chosen): As written by an older sp_lab."
    path = _edited(tmp_path / "without", lambda doc: doc["vllm"].pop("does"))
    assert _lines(describe_file(path))[3].startswith("vLLM 0.31.0 (chosen): In vLLM 0.31.0 this runs SP + AsyncTP "
                                                      "from 256 tokens")


def test_a_closest_choice_without_its_regret_says_na(tmp_path):
    path = _edited(tmp_path, lambda doc: doc["vllm"]["closest"]["never"].pop("regret"), release="0.34")
    lines = _lines(describe_file(path))
    assert lines[4] == "closest it can run: never (worst n/a, total n/a)"
    assert lines[5] == "vllm serve meta-llama/Meta-Llama-3-70B --tensor-parallel-size 4"


def test_a_string_that_cannot_name_a_file_is_a_config_error_naming_a_tuned_config():
    with pytest.raises(ConfigError, match="^tuned config: 'a\\\\nb' is neither JSON text"):
        describe_file("a\nb")


def test_where_never_loses_less_than_always_the_serve_line_is_nevers(tmp_path):
    """Fusion pays only at 4096 tokens: 'never' loses 25% there (25% in all), 'always' 10% at each of the four
    smaller sizes (40%); vLLM 0.15 serves never's line, and there is then nothing to compare it with."""
    rows = _sweep_rows("llama-3-70b").with_columns(
        latency_us=pl.when((pl.col("variant") == "sp+async_tp") & (pl.col("num_tokens") < 4096))
        .then(110.0).otherwise(pl.col("latency_us")))
    config = LabConfig(tp_size=4, async_tp_min_tokens=4096, max_num_tokens=8192)
    lines = _lines(describe_file(export_config(rows, config, tmp_path, chosen_in="test", vllm_release="0.15")))
    assert lines[4:6] == ["closest it can run: never (worst 25.0%, total 25.0%)",
                          "closest it can run: always (worst 10.0%, total 40.0%)"]
    assert lines[6] == ("vllm serve meta-llama/Meta-Llama-3-70B --tensor-parallel-size 4 --compilation-config "
                        """'{"mode":3,"pass_config":{"enable_sp":false,"fuse_gemm_comms":false},"cudagraph_mode":"NONE"}'""")
    assert lines[-1].startswith("next: the line above is the 'never' line itself")


def test_closest_choices_without_their_regret_serve_the_first_never(tmp_path):
    """A file whose closest choices carry no regret (written before it was computed) cannot rank them: the
    description says n/a and serves the first, 'never'."""
    def drop_regret(doc):
        for choice in doc["vllm"]["closest"].values():
            choice.pop("regret")

    lines = _lines(describe_file(_edited(tmp_path, drop_regret, release="0.15")))
    assert lines[4:6] == ["closest it can run: never (worst n/a, total n/a)",
                          "closest it can run: always (worst n/a, total n/a)"]
    assert lines[6].startswith("vllm serve meta-llama/Meta-Llama-3-70B --tensor-parallel-size 4 --compilation-config "
                               """'{"mode":3,"pass_config":{"enable_sp":false""")


def test_a_file_without_its_vllm_section_is_refused_naming_the_file_and_how_to_write_it_again(tmp_path):
    path = export_config(_sweep_rows("llama-3-70b"), CONFIG, tmp_path, chosen_in="test", vllm_release="0.31")
    doc = json.loads(path.read_text())
    for edit in ({k: v for k, v in doc.items() if k != "vllm"}, {**doc, "vllm": {"does": "hand-written"}}):
        path.write_text(json.dumps(edit))
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: no vllm section with its release .*"
                                              r"python -m sp_lab export --store DIR"):
            describe_file(path)
