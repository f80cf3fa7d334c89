"""The sweep's HTML report (sp_lab.viz.sweep_report): what it says about rows measured in separate sweeps."""

from __future__ import annotations

import polars as pl
import pytest
from test_cli import curve_rows
from test_store import make_row

from sp_lab.config import LabConfig
from sp_lab.programs import Policy
from sp_lab.viz.sweep_report import tuned_drift, write_report

pytest.importorskip("plotly", reason="the report draws with plotly")


def test_tuned_rows_from_a_later_sweep_carry_their_measured_drift(tmp_path):
    """The tuned config runs baseline below 64 and sp+async_tp from 64; its later sweep ran every point 0.8x as
    long as the same program in the reference sweep. The report says 0.80x and labels the curve with it, instead
    of drawing a tuned curve 20% faster than the program it runs without a word."""
    reference = curve_rows()
    by_point = {(r["num_tokens"], r["variant"]): r["latency_us"] for r in reference}
    config = Policy.gate("baseline", "sp+async_tp", 64).to_config(LabConfig(tp_size=2))
    tuned = [make_row(t, variant="tuned", reported_variant="tuned", config_hash="tuned", sweep_id="s1",
                      latency_us=0.8 * by_point[(t, "baseline" if t < 64 else "sp+async_tp")])
             for t in (1, 4, 16, 64, 256)]
    rows = pl.DataFrame(reference + tuned)
    assert tuned_drift(rows, config) == pytest.approx(0.8)
    assert tuned_drift(pl.DataFrame(reference), config) is None
    page = write_report(rows, tmp_path / "report.html", store=str(tmp_path), config=config,
                        predicted=False).read_text()
    assert "ran <b>0.80x</b> the latency of the variant the config runs" in page
    assert "tuned (later sweep: 0.80x the program it runs)" in page


def test_a_report_shows_one_setup_names_it_and_lists_the_others_with_their_row_counts(tmp_path):
    """A store holds rows of several setups: the report draws one (the newest, or the one asked for), its heading
    names that one, and the page lists the others with their row counts and how to ask for them; the summary says
    how many rows of which source (not "measured" for predicted or replayed rows), the figure's title their
    provenance."""
    rows = pl.DataFrame(curve_rows() + curve_rows(model="llama-3-70b", tp=8, device_name="NVIDIA H200",
                                                  dtype="bfloat16", source="replayed",
                                                  timestamp="2025-02-01T00:00:00.000+00:00"))
    page = write_report(rows, tmp_path / "report.html", store=str(tmp_path), predicted=False).read_text()
    assert "<h1>sp_lab report: llama-3-70b, tp=8, bfloat16, NVIDIA H200</h1>" in page  # the newest
    assert "15 rows (15 replayed) from" in page
    assert "This report shows one setup of the 2 the rows hold" in page
    assert "--setup model=toy,tp=2,dtype=float32,device_name=cpu: test: 15 rows, measured" in page
    asked = write_report(rows, tmp_path / "toy.html", store=str(tmp_path), predicted=False,
                         setup={"model": "toy"}).read_text()
    assert "<h1>sp_lab report: toy, tp=2, float32, cpu: test</h1>" in asked and "15 rows (15 measured) from" in asked
    drawn = asked.split("<h2>Latency and regret</h2>")[1]  # the figure, what ran, the provenance table
    assert "cpu: test" in drawn and "NVIDIA H200" not in drawn and "llama-3-70b" not in drawn
    assert "--setup model=llama-3-70b,tp=8,dtype=bfloat16,device_name=NVIDIA H200: 15 rows, replayed" in asked
    one = pl.DataFrame(curve_rows(source="predicted"))
    page = write_report(one, tmp_path / "one.html", store=str(tmp_path), predicted=False).read_text()
    assert "<h1>sp_lab report: toy, tp=2, float32, cpu: test</h1>" in page and "15 rows (15 predicted) from" in page
    assert "This report shows one setup" not in page
    assert "device cpu: test · torch 2.13.0" in page and "source: predicted" in page  # the latency figure's title


def test_fusion_missing_rows_are_spelled_one_way_in_the_text_and_the_figure(tmp_path):
    from sp_lab.vocabulary import FUSION_MISSING_SUFFIX

    rows = pl.DataFrame(curve_rows() + [make_row(512, variant="sp+async_tp", config_hash="sp+async_tp",
                                                 reported_variant="sp+async_tp" + FUSION_MISSING_SUFFIX,
                                                 fusion_missing=True, fusion_expected=True)])
    page = write_report(rows, tmp_path / "report.html", store=str(tmp_path), predicted=False).read_text()
    assert "drawn and listed as '&lt;variant&gt; [fusion missing]'" in page
    assert '"name":"sp+async_tp [fusion missing]"' in page  # the legend entry of the figure
    assert "fusion did not fire" not in page


def test_the_compile_overview_has_a_heading_of_its_own(tmp_path):
    """The overview of a compile report came straight under the latency figure, as if part of it."""
    from pathlib import Path

    report = Path(__file__).parent / "data" / "report_toy_sharded.json"
    page = write_report(pl.DataFrame(curve_rows()), tmp_path / "report.html", store=str(tmp_path),
                        compile_report=report, predicted=False).read_text()
    sections = page.split("<h2>")
    latency = next(s for s in sections if s.startswith("Latency and regret</h2>"))
    overview = next(s for s in sections if s.startswith("Compiled pieces and boundaries</h2>"))
    assert latency.count("Plotly.newPlot") == 1 and overview.count("Plotly.newPlot") == 1
    assert str(report) in overview

