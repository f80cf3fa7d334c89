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
