"""The serving plots: their data from a verdict worked out by hand, and figures that carry it (smoke-tested)."""

from __future__ import annotations

import math

import pytest
from test_serving_verdict import rows

from sp_lab.serving.scheduler import SchedulerLimits
from sp_lab.serving.step_costs import LatencyCurves
from sp_lab.serving.traffic import Request, Traffic
from sp_lab.serving.verdict import evaluate
from sp_lab.viz.traffic import curves_data, histogram_data, latencies_data, plot_latencies, plot_step_sizes


def test_step_size_plot_carries_the_histogram_the_curves_and_both_thresholds():
    curves = LatencyCurves.from_rows(rows())
    v = evaluate(curves, [1] * 90 + [4096] * 10)
    hist = histogram_data(v)
    assert hist.select("low", "high", "steps").rows() == [(1, 1, 90), (4096, 8191, 10)]
    assert curves_data(curves).height == 6
    fig = plot_step_sizes(v, curves)
    names = [t.name for t in fig.data]
    assert "baseline (measured)" in names and "share of step time" in names
    time_trace = next(t for t in fig.data if t.name == "share of step time")
    assert list(time_trace.x) == [1, 1, 2, 2, 4096, 4096, 8192, 8192]
    small, large = 100 * 900 / 10900, 100 * 10000 / 10900
    assert list(time_trace.y) == pytest.approx([0, small, small, 0, 0, large, large, 0])
    # lines at the thresholds' token counts on both panels; labels at log10 of them (plotly's log-axis annotations)
    # (both thresholds are 4096 here: one line each on each panel)
    assert sorted((sh.x0, sh.xref) for sh in fig.layout.shapes) == [(4096, "x"), (4096, "x"), (4096, "x2"), (4096, "x2")]
    assert "MEASURED" in fig.layout.title.text
    label = next(a for a in fig.layout.annotations if a.text == "threshold per count: 4096")
    assert label.x == pytest.approx(math.log10(4096))


def test_latency_plot_has_ttft_and_tpot_per_policy_and_refuses_a_step_list():
    curves = LatencyCurves.from_rows(rows())
    v = evaluate(curves, Traffic.of([Request(0, 64, 3), Request(0, 1, 5)]), limits=SchedulerLimits(4096, 8))
    data = latencies_data(v)
    assert set(data["metric"]) == {"TTFT", "TPOT"} and data.height == 6 * len(v.results)
    assert len(plot_latencies(v).data) == 6
    with pytest.raises(ValueError, match="no TTFT or TPOT"):
        plot_latencies(evaluate(curves, [1, 2]))


def test_the_html_report_prices_chat_traffic_on_its_own_rows(tmp_path):
    import polars as pl
    from test_cli import curve_rows

    from sp_lab.viz.sweep_report import write_report

    rows = pl.DataFrame(curve_rows())  # toy, tp 2, measured at 1..256 tokens; fusion pays from 64
    page = write_report(rows, tmp_path / "report.html", store=str(tmp_path), predicted=False).read_text()
    section = page.split("<h2>On serving traffic</h2>")[1]
    assert "<b>[measured]</b> sp+async_tp from 64:" in section
    assert "a budget of 256 tokens" in section and "Where the traffic" in section
    late = pl.DataFrame([r for r in curve_rows() if r["num_tokens"] > 1])
    page = write_report(late, tmp_path / "late.html", store=str(tmp_path), predicted=False).read_text()
    assert "Not priced on serving traffic: the rows start at 4 tokens" in page
    quiet = write_report(rows, tmp_path / "q.html", store=str(tmp_path), predicted=False, traffic=False).read_text()
    assert "On serving traffic" not in quiet
