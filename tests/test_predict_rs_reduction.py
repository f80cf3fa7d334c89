"""The reduce_scatter side's own cost at tp ranks: the one-rank measurement (H200) with its [1, M, N] sum swapped
for the [tp, M / tp, N] sum a tp-rank op runs, by the ratio measured in one run on one H100. Checked by hand."""

from __future__ import annotations

import json

import pytest

from sp_lab.resources import DATA_DIR
from sp_lab.tuning.predict.hardware import gpu
from sp_lab.tuning.predict.kernels import KernelModel, default_table, rs_own_cost_ratio

H100 = json.loads((DATA_DIR / "h100" / "rs_reduction.json").read_text())
SUMS = {(r["m"], r["tp"]): r["us"] for r in H100["rows"]}
ONE_RANK = {r["m"]: r for r in H100["one_rank_fused"]}


def _h200(variant: str, m: int, n: int, k: int) -> float:
    """The shipped H200 row (data/h200/matmul_single_gpu.json), as the table reads it back."""
    table = default_table()
    return table.fused_ws1_us(m, n, k) if variant == "fused_ws1" else table.mm_us(m, n, k)


def test_the_one_rank_own_cost_is_its_degenerate_sum():
    # what makes the swap meaningful: on the H100, fused minus plain matmul is the [1, M, N] sum within ~1 %
    r = ONE_RANK[8192]
    assert r["fused_ws1_us"] - r["mm_us"] == pytest.approx(SUMS[8192, 1], rel=0.02)


def test_own_cost_at_tp8_by_hand_from_the_table_rows():
    m, n, k, tp = 8192, 8192, 1024, 8  # o_proj at tp 8, a measured row in both tables
    r = ONE_RANK[m]
    own_h100 = r["fused_ws1_us"] - r["mm_us"]
    ratio = (own_h100 - SUMS[m, 1] + SUMS[m, tp]) / own_h100
    want = (_h200("fused_ws1", m, n, k) - _h200("mm", m, n, k)) * ratio  # the target is the H200: no scaling
    got = KernelModel(default_table(), gpu("h200")).fused_overhead_us("rs", m, n, k, tp)
    assert got == pytest.approx(want, rel=1e-9)
    assert 0.2 < ratio < 0.4  # measured: the tp-rank sum runs near the HBM rate, the one-rank one far below


def test_ratio_interpolates_between_measured_sizes_and_holds_at_the_ends():
    lo, hi = rs_own_cost_ratio(2 * 4096 * 8192, 8), rs_own_cost_ratio(2 * 8192 * 8192, 8)
    mid = rs_own_cost_ratio(2 * 6144 * 8192, 8)
    assert min(lo, hi) <= mid <= max(lo, hi)
    assert rs_own_cost_ratio(1.0, 8) == pytest.approx(rs_own_cost_ratio(2 * 512 * 8192, 8))
    assert rs_own_cost_ratio(1e15, 8) == pytest.approx(rs_own_cost_ratio(2 * 32768 * 8192, 8))


def test_all_gather_side_and_unmeasured_tp_keep_the_one_rank_cost():
    km = KernelModel(default_table(), gpu("h200"))
    m, n, k = 8192, 8192, 1024
    one_rank = _h200("fused_ws1", m, n, k) - _h200("mm", m, n, k)
    assert rs_own_cost_ratio(2 * m * n, 3) == 1.0
    assert km.fused_overhead_us("rs", m, n, k, 3) == pytest.approx(one_rank)
    assert km.fused_overhead_us("rs", m, n, k, 1) == pytest.approx(one_rank)
