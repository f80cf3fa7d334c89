"""The 95% interval of a median (sp_lab.bench.timing.median_ci) covers the true median about 95% of the time.

Coverage is measured, not recomputed: many seeded samples are drawn from distributions whose median is known
in closed form (a log-normal, skewed like timing noise, and an exponential), and the fraction of intervals
that contain that median is counted. With 4000 samples per size the count's standard error is 0.0035, so the
stated tolerance (0.94 to 0.985 at each size, at least 0.95 on average) is several standard errors wide.
An interval built for 90% (1.645 instead of 1.96) covers 0.92-0.95 at these sizes and fails.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sp_lab.bench.interleave import PointTiming
from sp_lab.bench.timing import median_ci

SIZES = (60, 100, 150, 200, 300)
"""Sample counts where the order statistics are fine-grained enough for the coverage to be near its level
(at a handful of samples the only interval is (min, max), which covers more)."""
TRIALS = 4000
LOW, HIGH, MEAN_LOW = 0.94, 0.985, 0.95

DISTRIBUTIONS = {
    # name: (draw(rng, shape) -> samples in us, true median in us)
    "lognormal": (lambda rng, shape: rng.lognormal(math.log(100.0), 0.5, shape), 100.0),
    "exponential": (lambda rng, shape: 50.0 + rng.exponential(20.0, shape), 50.0 + 20.0 * math.log(2.0)),
}


def _coverage(interval, draw, median: float, seed: int) -> dict[int, float]:
    rng = np.random.default_rng(seed)
    covered = {}
    for n in SIZES:
        samples = draw(rng, (TRIALS, n))
        hits = 0
        for row in samples.tolist():
            lo, hi = interval(row)
            hits += lo <= median <= hi
        covered[n] = hits / TRIALS
    return covered


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_median_ci_covers_the_true_median_95_percent_of_the_time(name):
    draw, median = DISTRIBUTIONS[name]
    covered = _coverage(lambda s: median_ci(s, 0.95), draw, median, seed=1)
    assert all(LOW <= c <= HIGH for c in covered.values()), f"coverage of the 95% interval by size: {covered}"
    assert sum(covered.values()) / len(covered) >= MEAN_LOW, f"coverage of the 95% interval by size: {covered}"


def test_the_interval_a_sweep_records_is_the_95_percent_one():
    """What a sweep row stores (``ci_low_us`` / ``ci_high_us`` from :meth:`PointTiming.summary`) has the coverage
    its column comment promises."""
    draw, median = DISTRIBUTIONS["lognormal"]

    def recorded(samples: list[float]) -> tuple[float, float]:
        row = PointTiming(samples_us=tuple(samples), method="perf_counter", note="").summary()
        return row["ci_low_us"], row["ci_high_us"]

    covered = _coverage(recorded, draw, median, seed=2)
    assert all(LOW <= c <= HIGH for c in covered.values()), f"coverage of the recorded interval by size: {covered}"
    assert sum(covered.values()) / len(covered) >= MEAN_LOW, f"coverage of the recorded interval by size: {covered}"


def test_a_wider_level_gives_a_wider_interval_and_too_few_samples_give_the_range():
    samples = list(np.random.default_rng(3).lognormal(0.0, 0.5, 101))
    lo90, hi90 = median_ci(samples, 0.90)
    lo95, hi95 = median_ci(samples, 0.95)
    lo99, hi99 = median_ci(samples, 0.99)
    assert lo99 <= lo95 <= lo90 < hi90 <= hi95 <= hi99
    assert (lo99, hi99) != (lo90, hi90)
    assert median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)
    with pytest.raises(ValueError, match="no timing samples"):
        median_ci([])
