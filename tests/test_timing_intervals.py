"""Below MIN_CI_SAMPLES samples a median has no 95% interval: rows record none and the stop rule never stops on one.

The range (min, max) of n samples covers the median with probability 1 - 2**(1 - n): 0% at one sample, 94% at five.
"""

from __future__ import annotations

import pytest

from sp_lab.bench.interleave import PointTiming, StopRule
from sp_lab.bench.timing import MIN_CI_SAMPLES, median_ci


def test_six_samples_are_the_fewest_with_a_95_percent_interval():
    assert MIN_CI_SAMPLES == 6
    assert 1 - 2 ** (1 - (MIN_CI_SAMPLES - 1)) < 0.95 <= 1 - 2 ** (1 - MIN_CI_SAMPLES)


@pytest.mark.parametrize("n", range(1, MIN_CI_SAMPLES))
def test_the_stop_rule_never_stops_on_an_interval_of_fewer_than_six_samples(n):
    identical = [100.0] * n  # the range has width 0: the old rule stopped on it at once
    rule = StopRule(repeats=1, max_repeats=50, ci_width=10.0, budget_s=None, points_left=1)
    assert rule.reason({"a": identical, "b": identical}, 0.0, None) is None
    # it stops on what else there is, and says there is no interval
    capped = StopRule(repeats=1, max_repeats=n, ci_width=10.0, budget_s=None, points_left=1)
    why = capped.reason({"a": identical, "b": identical}, 0.0, None)
    assert why.startswith(f"max_repeats={n} reached") and "too few rounds for a 95% interval" in why
    why = rule.reason({"a": identical}, 2.0, 1.0)
    assert why.startswith(f"time budget spent after {n} rounds") and "intervals within" not in why


def test_the_stop_rule_stops_on_the_interval_from_six_samples_on():
    rule = StopRule(repeats=1, max_repeats=50, ci_width=0.05, budget_s=None, points_left=1)
    narrow = [100.0, 101.0, 99.0, 100.0, 102.0, 98.0]
    assert rule.reason({"a": narrow[:5]}, 0.0, None) is None
    assert rule.reason({"a": narrow}, 0.0, None) == "intervals within 5% of the medians after 6 rounds"


@pytest.mark.parametrize("n", range(1, MIN_CI_SAMPLES))
def test_a_row_of_fewer_than_six_samples_records_no_interval(n):
    samples = tuple(float(100 + i) for i in range(n))
    row = PointTiming(samples_us=samples, method="perf_counter", note="").summary()
    assert row["ci_low_us"] is None and row["ci_high_us"] is None
    assert median_ci(list(samples)) == (min(samples), max(samples))  # the range, which is no 95% interval


def test_a_row_of_six_samples_or_more_records_the_95_percent_interval():
    samples = tuple(float(v) for v in (100, 103, 99, 101, 120, 98, 100))
    row = PointTiming(samples_us=samples, method="perf_counter", note="").summary()
    assert (row["ci_low_us"], row["ci_high_us"]) == median_ci(list(samples), 0.95)
    assert row["ci_low_us"] <= row["latency_us"] <= row["ci_high_us"]
