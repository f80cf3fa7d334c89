"""What export_config refuses (no rows, predictions not asked for, an unknown release, a serving answer of other
rows) and what the file it writes says about where its numbers come from: the rows' source, backend and boundary,
the recommendation, the rows' hash in each section, the serving answer, and the warning for rows that cannot answer
for GPUs."""

import json
import warnings

import polars as pl
import pytest
from test_export_file import CONFIG, _lines, _sweep_rows

from sp_lab.bench.store import data_hash
from sp_lab.config import ConfigError
from sp_lab.models.llama import ModelSpec
from sp_lab.serving.on_rows import serving_answer
from sp_lab.tuning.export import (
    ExportError,
    describe_file,
    export_config,
    export_tuned_config,
    function_path,
    snippet_path,
)
from sp_lab.tuning.policy import recommend

ROWS = _sweep_rows("llama-3-70b")


def _doc(path) -> dict:
    return json.loads(path.read_text())


def test_no_rows_are_refused_with_what_to_run(tmp_path):
    with pytest.raises(ExportError) as e:
        export_config(ROWS.clear(), CONFIG, tmp_path, chosen_in="test")
    assert str(e.value) == ("no rows: run a sweep (python -m sp_lab run) or replay recorded rows before exporting")
    assert not list(tmp_path.iterdir())


def test_a_single_row_is_enough_to_write_a_file(tmp_path):
    """One measured token count (baseline only): the file says so, with that one count's regret."""
    rows = ROWS.head(1).with_columns(device_name=pl.lit("NVIDIA H100"))
    prov = _doc(export_config(rows, CONFIG, tmp_path, chosen_in="test", vllm_release="0.31"))["provenance"]
    assert (prov["sweep_rows"], prov["device"], prov["source"]) == (1, "NVIDIA H100", "measured")
    assert prov["regret"]["per_token"] == {"64": {"ran": "baseline", "best": "baseline", "regret_rel": 0.0}}


def test_predicted_rows_are_refused_unless_asked_for(tmp_path):
    rows = ROWS.with_columns(source=pl.when(pl.col("num_tokens") == 4096).then(pl.lit("predicted"))
                             .otherwise(pl.col("source")))
    with pytest.raises(ExportError) as e:
        export_config(rows, CONFIG, tmp_path, chosen_in="test")
    assert str(e.value) == (
        "these rows are predictions (source='predicted'), not measurements; export them only on purpose: "
        "allow_predicted=True (CLI: python -m sp_lab predict --export-predicted DIR)")
    assert not list(tmp_path.iterdir())


def test_rows_without_a_source_column_export_with_no_source(tmp_path):
    prov = _doc(export_config(ROWS.drop("source"), CONFIG, tmp_path, chosen_in="test",
                              vllm_release="0.31"))["provenance"]
    assert prov["source"] is None and prov["sweep_rows"] == 15


def test_an_unknown_release_is_refused_naming_it_and_how_to_choose(tmp_path):
    with pytest.raises(ConfigError) as e:
        export_config(ROWS, CONFIG, tmp_path, chosen_in="test", vllm_release="0.1")
    message = str(e.value)
    assert message.startswith("vLLM release: ") and "0.1" in message
    assert message.endswith("; name a release to write for with vllm_release=")
    assert not list(tmp_path.iterdir())


def test_the_boundary_and_the_recommendation_are_written_as_given(tmp_path):
    rows = ROWS.with_columns(boundary=pl.lit("replicated"))
    rec = recommend(rows, CONFIG, n_boot=50)
    prov = _doc(export_config(rows, rec.config, tmp_path, recommendation=rec, chosen_in="test",
                              vllm_release="0.31"))["provenance"]
    assert prov["boundary"] == "replicated"
    assert prov["recommendation"] == json.loads(json.dumps(rec.to_dict()))
    assert prov["recommendation"]["async_tp_min_tokens"] == 256
    assert "recommendation" not in _doc(export_config(rows, CONFIG, tmp_path / "plain", chosen_in="test",
                                                      vllm_release="0.31"))["provenance"]


def test_each_section_and_file_beside_it_names_the_rows_it_came_from(tmp_path):
    path = export_config(ROWS, CONFIG, tmp_path, chosen_in="test", vllm_release="0.31")
    doc, rows_hash = _doc(path), data_hash(ROWS)
    assert doc["model_sp"]["provenance"]["data_hash"] == rows_hash
    assert f"rows {rows_hash}" in function_path(path).read_text()
    tuned = (f"# Tuned by sp_lab: baseline below 256, sp+async_tp from 256, tuned on NVIDIA H200, tp 4, bfloat16, "
             f"torch 2.11.0, rows {rows_hash}.")
    assert tuned in doc["torch_compile"]["snippet"].splitlines()
    assert snippet_path(path).read_text() == doc["torch_compile"]["snippet"]
    assert "serving" not in doc


def test_rows_whose_fusion_did_not_fire_export_without_warning_again(tmp_path):
    """The tuner already said rows were left out; the export (its regret tables, the closest choices') does not."""
    rows = ROWS.with_columns(fusion_missing=pl.col("num_tokens") == 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = export_config(rows, CONFIG, tmp_path, chosen_in="test")  # newest release: a closest choice
    assert "never" in _doc(path)["vllm"]["closest"]


def test_the_serving_answer_of_the_rows_is_written_and_one_of_other_rows_refused(tmp_path):
    traffic = serving_answer(ROWS, config=CONFIG)
    path = export_config(ROWS, CONFIG, tmp_path, chosen_in="test", vllm_release="0.31", traffic=traffic)
    assert _doc(path)["serving"] == json.loads(json.dumps(traffic.to_dict()))
    assert "serving (chat traffic, measured rows): not priced: the rows start at 64 tokens" in describe_file(path)
    other = serving_answer(ROWS.head(6))
    with pytest.raises(ExportError) as e:
        export_config(ROWS, CONFIG, tmp_path / "other", chosen_in="test", vllm_release="0.31", traffic=other)
    assert str(e.value) == (f"the serving answer was computed from rows {other.rows_hash}, not these "
                            f"({data_hash(ROWS)}): compute it from the rows exported "
                            "(sp_lab.serving.on_rows.serving_answer(rows))")
    assert not (tmp_path / "other").exists()


def test_a_model_vllm_has_no_class_for_gets_no_model_level_section(tmp_path):
    path = export_config(_sweep_rows("toy"), CONFIG, tmp_path, chosen_in="test", vllm_release="0.34")
    assert "vllm" not in _doc(path)["model_sp"]
    assert not list(tmp_path.glob("*.patch"))


def test_a_model_spec_is_written_as_its_fields_into_a_new_nested_directory(tmp_path):
    spec = ModelSpec(name="llama-3-8b", hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                     num_kv_heads=8, head_dim=128, vocab_size=128256, dtype="bfloat16", residual_inplace=True)
    path = export_tuned_config(CONFIG, directory=tmp_path / "a" / "b", device_name="NVIDIA H200",
                               model_spec=spec, dtype="torch.bfloat16", data_hash="abc", vllm_release="0.31.0")
    assert path.parent == tmp_path / "a" / "b"
    assert path.name == "device_name=NVIDIA_H200,tp=4,model=llama-3-8b,dtype=bfloat16.json"
    assert _doc(path)["provenance"]["model"] == spec.to_dict()


@pytest.mark.parametrize(("changes", "why"), [
    ({"source": "rehearsal"}, "rehearsal rows (ranks sharing one GPU): no real overlap between ranks."),
    ({"backend": "gloo"}, ("gloo on CPU: collectives do not overlap with matmuls there and the fused kernels are "
                           "sp_lab's chunked CPU stand-ins, so this says nothing about GPUs.")),
])
def test_the_warning_for_rows_that_cannot_answer_for_gpus_says_why_in_full(tmp_path, changes, why):
    rows = ROWS.with_columns(**{k: pl.lit(v) for k, v in changes.items()})
    lines = _lines(describe_file(export_config(rows, CONFIG, tmp_path, chosen_in="test", vllm_release="0.31")))
    assert lines[3] == f"WARNING: tuned on {why}"


def test_a_file_without_a_device_is_not_warned_about(tmp_path):
    path = export_config(ROWS, CONFIG, tmp_path, chosen_in="test", vllm_release="0.31")
    doc = _doc(path)
    del doc["provenance"]["device"]
    path.write_text(json.dumps(doc))
    assert not [line for line in _lines(describe_file(path)) if line.startswith("WARNING")]
