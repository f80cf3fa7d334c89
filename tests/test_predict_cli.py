"""Where users meet the performance model: ``python -m sp_lab predict`` (labelled curves, crossover, config,
clear errors), the explicit export of a predicted config, and the validation table's verdicts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sp_lab import cli
from sp_lab.tuning.export import export_config
from sp_lab.tuning.predict import collected
from sp_lab.tuning.predict import validation as V
from sp_lab.tuning.predict.advice import predict

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("argv", "message"), [
    (["predict", "--gpu", "h300"], ("unknown GPU 'h300'; allowed: a100_sxm, b200_sxm, b300_sxm, gb200, gb300, "
     "h100-hbm2e, h100_pcie, h100_sxm, h200_sxm, h800, l40s, rtx_pro_6000_server, b200 (= b200_sxm)")),
    (["predict", "--model", "llama-9"], "unknown model 'llama-9' for a prediction; allowed: llama-2-7b, llama-3-70b"),
    (["predict", "--dtype", "int3"], "unsupported dtype 'int3'"),
    (["predict", "--tp", "3"], "tp=3 does not divide"),
    (["predict", "--tp", "16"], ("tp=16: predictions model one 8-GPU board (its NVLink / NVSwitch); tensor "
                                 "parallelism across nodes is not modelled: pick a tp of at most 8")),
])
def test_bad_values_are_clear_errors(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_tp_beyond_one_board_is_refused_before_any_prediction(monkeypatch):
    from sp_lab.tuning.predict import advice

    monkeypatch.setattr(advice, "predict_layers", lambda *a, **k: pytest.fail("predicted before refusing"))
    with pytest.raises(ValueError, match="tp=16: predictions model one 8-GPU board"):
        predict("llama-3-70b", 16, "h200")


@pytest.fixture(scope="module")
def h200():
    return predict("llama-3-70b", 8, "h200", tokens=[16, 512, 4096, 16384])


def test_cli_prints_labelled_curves_crossover_and_config(capsys):
    assert cli.main(["predict", "--model", "llama-3-70b", "--tp", "8", "--gpu", "h200", "--tokens",
                     "16,512,4096,16384", "--modelled-only"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PREDICTED (source: predicted), not measured: llama-3-70b, tp 8, 8x H200")
    assert "busbw 360 GB/s" in out  # modelled: the interconnect's constants are printed with it
    assert "terms: modelled: matmuls" in out and "collected tables turned off" in out
    assert re.search(r"tokens +baseline +sp +sp\+async_tp +tuned +fastest", out)
    curves = [line.split() for line in out.splitlines() if re.match(r"\s+\d+(\s+[\d.]+){4}\s+\S+$", line)]
    assert [int(c[0]) for c in curves] == [16, 512, 4096, 16384]
    for tokens, *ms, fastest in curves:  # the "fastest" column names the smallest of the four printed values
        assert fastest == ("baseline", "sp", "sp+async_tp", "tuned")[min(range(4), key=lambda i: float(ms[i]))]
    assert re.search(r"Predicted crossover sp\+async_tp over baseline: \d+ tokens \(band \d+-\d+\)", out)
    assert "Predicted config (source: predicted): model=llama-3-70b, tp=8, gpu=h200" in out


def test_predicted_config_follows_the_crossover(h200):
    cfg = h200.config()
    assert cfg.tp_size == 8 and cfg.enable_sp and cfg.enable_async_tp
    assert cfg.async_tp_min_tokens == h200.async_tp.tokens
    assert h200.async_tp.low <= h200.async_tp.tokens <= h200.async_tp.high
    assert (h200.rows["source"] == "predicted").all()


def test_export_of_predictions_is_explicit_and_marked(h200, tmp_path, capsys):
    with pytest.raises(ValueError, match="these rows are predictions"):
        export_config(h200.rows, h200.config(), tmp_path, chosen_in="test")
    assert cli.main(["predict", "--tokens", "512,4096", "--export-predicted", str(tmp_path)]) == 0
    assert "source: predicted -- not measured" in capsys.readouterr().out
    (path,) = tmp_path.glob("*.json")
    text = path.read_text()
    assert '"source": "predicted"' in text and "predicted: 8x H200" in text


def _figure(unit: str, published: float) -> V.Figure:
    return V.Figure(id="x", claim="x", source_title="t", source_url="u", setup={}, published=published, unit=unit,
                    differences="")


@pytest.mark.parametrize(("unit", "published", "predicted", "error", "verdict"), [
    ("x", 1.0, 1.10, 0.10, "hit"),
    ("x", 1.0, 0.80, -0.20, "miss"),
    ("tokens", 4096, 2048, -0.5, "hit"),   # within 2x
    ("tokens", 4096, 16384, 3.0, "miss"),
    ("x", 1.0, None, None, "not predicted"),
    ("x-lower-bound", 1.0, 0.90, -0.10, "undecided"),  # a step speedup bounds the layer's from below
    ("x-lower-bound", 1.0, 0.80, -0.20, "miss"),
    ("x-lower-bound", 1.0, 1.30, 0.30, "hit"),
])
def test_verdicts(unit, published, predicted, error, verdict):
    fig = _figure(unit.removesuffix("-lower-bound"), published)
    if unit.endswith("-lower-bound"):
        fig = V.Figure(**{**fig.__dict__, "setup": {"published_is": "lower_bound"}})
    got_error, got_verdict = V._verdict(fig, predicted)
    assert got_verdict == verdict
    assert got_error == (pytest.approx(error) if error is not None else None)


def test_figures_name_public_sources_and_fp8_is_predicted_from_its_table():
    from sp_lab.tuning.predict import kernels as K
    from sp_lab.tuning.predict.hardware import gpu

    figs = V.figures()
    assert {f.id for f in figs} >= {"kraken-19-m512", "torchtitan-70b-bf16", "vllm-sp-threshold-b200"}
    for f in figs:
        assert f.source_url.startswith("https://") and f.differences
    fp8 = next(f for f in figs if f.id == "torchtitan-70b-fp8")
    assert fp8.setup["dtype"] == "float8_tensorwise" and fp8.setup["published_is"] == "lower_bound"
    value, _ = V.predict_figure(fp8)
    assert value is not None and value > 0
    with pytest.raises(ValueError, match="no measured float8_tensorwise matmul table.*matmul_fp8_single_gpu.json"):
        K.KernelModel(K.MatmulTable.from_files(K.SINGLE_GPU_JSON, K.CHUNKING_TP8_JSON), gpu("h100"), "fp8-tensorwise")


@pytest.mark.skipif(not collected.available(), reason="docs/predictions.md is generated with the collected tables "
                    f"of aiconfigurator-core, not installed here: {collected.INSTALL_HINT}")
def test_docs_page_is_what_the_command_writes(tmp_path, capsys):
    """docs/predictions.md is regenerated by one command; a stale page (model or data changed) fails here."""
    out = tmp_path / "predictions.md"
    assert cli.main(["predict", "--validate", "--write", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_text() == (REPO / "docs" / "predictions.md").read_text()
    n = len(json.loads(V.FIGURES_JSON.read_text())["figures"])
    assert sum(1 for line in printed.splitlines() if re.search(r"\| (hit|miss|undecided|not predicted) \|$", line)) == n
    # the measured tp 1 rows with the prediction's error beside each token count
    measured = [line for line in printed.splitlines() if re.match(r"\| \d+ \| [\d.]+ \| [\d.]+ \| [+-]\d+% \|$", line)]
    tp1 = json.loads((REPO / "data" / "h200" / "tp1_latency.json").read_text())["rows"]
    want = sorted(r["num_tokens"] for r in tp1 if r["variant"] == "sp_lab full_and_piecewise")
    assert [int(line.split("|")[1]) for line in measured] == want


def test_a_miss_is_read_term_by_term():
    # vLLM #37489 at M = 512 is timed eagerly: the fused calls cost their host floor, two fused all_gather + matmul
    # calls, each the one-rank call's median eager time measured on the H200 (symm_mem_ws1.json) plus a copy and a
    # chunk matmul per remote chunk (7 at tp 8) at the host time of one eager op call (the smallest-M plain matmul);
    # and the same figure timed as device time is the graph-timing prediction.
    import dataclasses
    import statistics

    from sp_lab.resources import h200_file

    rows = json.loads(h200_file("symm_mem_ws1.json").read_text())["rows"]
    one_call = min(rows, key=lambda r: r["M"])["mm_ag_eager"]
    floor = 2 * (statistics.median(r["fused_ag_mm_eager"] for r in rows) + 7 * 2 * one_call)
    fig = next(f for f in V.figures() if f.id == "vllm-37489-m512")
    text = V.miss_breakdown(fig)
    assert f"host floor {floor:.0f} us" in text and "8 chunk matmuls" in text
    graph, _ = V.predict_figure(dataclasses.replace(fig, setup={**fig.setup, "timing": "graph"}))
    assert text.endswith(f"Timed as device time (CUDA graphs) instead: {graph:.2f}x.")
