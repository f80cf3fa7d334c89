"""Serving traffic on a sweep's own rows: the tuner's traffic-weighted regret and the exported config's ``serving``
section (pure Python / polars: no compile, no rank)."""

from __future__ import annotations

import html
import json
from types import SimpleNamespace

import polars as pl
import pytest
from test_cli import curve_rows
from test_tuner import LATENCY, TOKENS, _row

pytest.importorskip("plotly", reason="the tuner and the report draw with plotly (optional on GPU machines)")
from sp_lab import cli
from sp_lab.config import LabConfig
from sp_lab.programs import Policy
from sp_lab.serving import workloads
from sp_lab.serving.on_rows import serving_answer
from sp_lab.serving.scheduler import SchedulerLimits
from sp_lab.serving.step_costs import LatencyCurves
from sp_lab.serving.verdict import evaluate
from sp_lab.serving.workloads import Lengths, Workload, workload
from sp_lab.tuning.export import ExportError, describe_file, export_config
from sp_lab.widgets.tuner import tune


@pytest.fixture
def one_token(monkeypatch):
    """A workload whose schedule is known by hand: 300 requests of one prompt token and one output token from 64
    users. Each step prefills 64 of them (their first token is their last), so with a budget of 512 the steps are
    64, 64, 64, 64 and 44 tokens."""
    monkeypatch.setitem(workloads.WORKLOADS, "one-token", Workload("one-token", Lengths(1), Lengths(1), "test"))
    return "one-token"


def test_the_tuner_weighs_its_regret_by_the_workloads_share_of_step_time(one_token, tmp_path):
    rows = pl.DataFrame([_row(v, t) for v in LATENCY for t in TOKENS])
    tuner = tune("toy", tp=2, store_dir=None, replay=rows, export_dir=tmp_path, workload=one_token)
    tuner.set_threshold(8)  # sp+async_tp from 8: loses 200/110 at 8 tokens and 50/200 at 64, nothing at 512
    # baseline's steps: four of 64 tokens (200 us each) and one of 44, priced between the rows at 8 and 64:
    # 110 + 90 * 36/56 us, of which 20/56 weighs the row at 8 and 36/56 the row at 64
    step44 = 110 + 90 * 36 / 56
    total = 4 * 200 + step44
    w8, w64 = step44 * 20 / 56 / total, (800 + step44 * 36 / 56) / total
    weighted = tuner.state.traffic_regret()
    assert dict(weighted.weights) == pytest.approx({1: 0.0, 8: w8, 64: w64, 512: 0.0})
    assert weighted.regret_rel == pytest.approx(w8 * 200 / 110 + w64 * 50 / 200)
    panel = tuner.regret_html.value
    # beside the per-count regret, labelled: which workload, what the weights are, which rows
    assert "summed over the token counts 206.8%" in panel  # 200/110 + 50/200, the per-count sum
    assert (f"regret on one-token traffic: {100 * weighted.regret_rel:.1f}% (each token count weighted by its share "
            "of baseline&#x27;s step time") in panel
    assert "budget 512 tokens; measured rows)" in panel and "share of one-token step time" in panel
    assert f"{100 * w64:.1f}%" in panel  # the weights are in the table
    tuner.workload.value = ""  # the dropdown back to per count: the weighted line goes
    assert tuner.state.workload is None and "one-token" not in tuner.regret_html.value


def test_the_tuner_says_why_a_workload_cannot_weigh_its_regret(tmp_path):
    rows = pl.DataFrame([_row(v, t) for v in LATENCY for t in TOKENS if t > 1])
    tuner = tune("toy", tp=2, store_dir=None, replay=rows, export_dir=tmp_path, workload="chat")
    assert ("<b>on chat traffic:</b> <i>not weighted: the rows start at 8 tokens; a decode step of one token cannot "
            "be priced") in tuner.regret_html.value
    with pytest.raises(ValueError, match="unknown workload 'chta'; choose from chat, lmsys-chat"):
        tune("toy", tp=2, store_dir=None, workload="chta")
    with pytest.raises(ValueError, match="unknown workload 'chta'"):
        tuner.set_workload("chta")
    assert tuner.state.workload == "chat"


def _exported(tmp_path, rows: pl.DataFrame, config: LabConfig) -> dict:
    path = export_config(rows, config, tmp_path, chosen_in="test", traffic=serving_answer(rows, config=config))
    return json.loads(path.read_text()), describe_file(path)


def test_the_exported_config_carries_the_serving_answer_of_its_own_rows(tmp_path):
    rows = pl.DataFrame(curve_rows())  # measured toy rows at 1..256 tokens; fusion pays from 64
    config = Policy.gate("baseline", "sp+async_tp", 64).to_config(LabConfig(tp_size=2))
    doc, said = _exported(tmp_path, rows, config)
    section = doc["serving"]
    # the same question priced by hand: chat traffic, 300 requests from 64 users, budget = the largest row count
    expected = evaluate(LatencyCurves.from_rows(rows), workload("chat").traffic(300, concurrency=64, max_model_len=8192),
                        limits=SchedulerLimits(256, 256), config=config)
    judged = expected.result(expected.judged)
    assert section["source"] == "measured" and section["workload"] == "chat"
    assert section["rows"].startswith("measured rows: model toy, tp 2, dtype float32, device_name cpu: test")
    assert section["rows_hash"] == doc["provenance"]["data_hash"]
    assert section["scheduler"]["max_num_batched_tokens"] == 256 and section["scheduler"]["max_num_seqs"] == 256
    assert section["policy"] == judged.policy == "sp+async_tp from 64"
    assert section["speedup_vs_baseline"] == pytest.approx(judged.speedup)
    assert section["interval_95"] == pytest.approx(list(judged.interval))
    assert section["this_config"]["speedup_vs_baseline"] == pytest.approx(expected.result("tuned config").speedup)
    assert section["sentence"] == expected.sentence and section["traffic"] == expected.traffic
    serving_lines = [line for line in said.splitlines() if "serving" in line]
    this = expected.result("tuned config").speedup
    line = f"  serving (chat traffic, budget 256 tokens): {expected.sentence} This config: {this:.2f}x vs baseline."
    assert serving_lines == [line]


def test_a_file_whose_rows_cannot_price_traffic_says_why_and_other_rows_answer_is_refused(tmp_path):
    rows = pl.DataFrame(curve_rows()).filter(pl.col("num_tokens") > 1)
    config = LabConfig(tp_size=2)
    doc, said = _exported(tmp_path, rows, config)
    assert doc["serving"] == {"workload": "chat", "source": "measured", "rows_hash": doc["provenance"]["data_hash"],
                              "not_priced": "the rows start at 4 tokens; a decode step of one token cannot be priced "
                                            "(sweep from --tokens 1)"}
    assert "  serving (chat traffic, measured rows): not priced: the rows start at 4 tokens" in said
    other = serving_answer(pl.DataFrame(curve_rows()))
    with pytest.raises(ExportError, match=r"the serving answer was computed from rows \w+, not these"):
        export_config(rows, config, tmp_path / "x", chosen_in="test", traffic=other)
    with pytest.raises(ValueError, match="unknown workload 'chta'"):
        serving_answer(rows, workload="chta")


def test_run_exports_the_serving_answer_of_the_rows_it_measured(tmp_path, monkeypatch, capsys):
    """``python -m sp_lab run`` with its sweep replaced by rows written to the store (no ranks, no compile)."""
    from sp_lab.bench.store import SweepStore
    from sp_lab.cli import run as run_command

    def fake_sweep(args, *, store, **kwargs):
        if not SweepStore(store).read().height:
            SweepStore(store).append(curve_rows())
        return SimpleNamespace(setup=None)

    monkeypatch.setattr(run_command, "sweep", fake_sweep)
    out = tmp_path / "out"
    assert cli.main(["run", "--out", str(out), "--no-validate", "--tokens", "1,4,16,64,256"]) == 0
    (path,) = out.glob("*.json")
    section = json.loads(path.read_text())["serving"]
    assert section["source"] == "measured" and section["scheduler"]["max_num_batched_tokens"] == 256
    assert "sp+async_tp from 64: pays on this traffic" in section["sentence"]
    printed = capsys.readouterr().out
    assert f"  serving (chat traffic, budget 256 tokens): {section['sentence']}" in printed
    assert html.escape(section["sentence"]) in (out / "report.html").read_text()  # the report's section says the same
