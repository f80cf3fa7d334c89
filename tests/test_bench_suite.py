"""``benchmarks/bench_suite.py`` reads what it reports correctly: pytest's result line, ``/proc/stat``'s fields,
the share of the machine others took.

The benchmark itself (a fresh-clone ``make test``) is far too long for the suite; these are the places where it
could report a wrong figure without failing.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench_suite():
    sys.path.insert(0, str(BENCHMARKS))  # the script imports its sibling machine.py
    try:
        yield importlib.import_module("bench_suite")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize(("output", "expected"), [
    ("....\n889 passed, 1 skipped, 29 warnings in 504.61s (0:08:24)\n",
     ("889 passed, 1 skipped, 29 warnings", 504.61)),
    ("==== 2 failed, 861 passed in 1056.20s (0:17:36) ====\nmake: *** [Makefile:61: test] Error 1\n",
     ("2 failed, 861 passed", 1056.2)),
    ("1 passed in 3.00s\n...\n3 errors in 12.5s\n", ("3 errors", 12.5)),  # the last summary counts
    ("ERROR: Could not install packages\n", ("no pytest summary", None)),
])
def test_pytest_summary_is_the_last_result_line(bench_suite, output, expected):
    assert bench_suite.pytest_summary(output) == expected


def test_cpu_seconds_split_busy_steal_and_idle_by_proc_stat_field(bench_suite):
    tick = os.sysconf("SC_CLK_TCK")
    # /proc/stat's cpu line: user nice system idle iowait irq softirq steal
    before = (1000, 10, 200, 5000, 40, 0, 7, 3)
    after = (1000 + 90 * tick, 10 + 1 * tick, 200 + 20 * tick, 5000 + 30 * tick, 40 + 2 * tick, 0, 7 + 1 * tick,
             3 + 5 * tick)
    cpu = bench_suite.CpuSeconds.between(before, after)
    assert (cpu.busy, cpu.steal, cpu.idle) == pytest.approx((112, 5, 32))
    assert bench_suite.CpuSeconds.between(None, after) is None


def test_busy_share_counts_what_others_took_stolen_time_included(bench_suite, monkeypatch):
    tick = os.sysconf("SC_CLK_TCK")
    # 10 s on 2 cores: 3 core-s busy, 1 stolen by the hypervisor, 16 idle.
    readings = iter([(0,) * 8, (2 * tick, 0, 1 * tick, 16 * tick, 0, 0, 0, 1 * tick)])
    monkeypatch.setattr(bench_suite.CpuSeconds, "ticks", staticmethod(lambda: next(readings)))
    monkeypatch.setattr(bench_suite.time, "sleep", lambda seconds: None)
    assert bench_suite.busy_share(10.0) == pytest.approx(4 / 20)
