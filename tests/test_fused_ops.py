"""sp_lab's CPU fused collective-matmul ops (``sp_lab/compiler/fused_ops.py``) against their definition.

One ``sp_lab.launch`` of 2 gloo ranks checks both ops for even and uneven shard contents and the
error for rows that do not split; the fake (meta) implementations and the CUDA probe run in process.
No Inductor here: these tests cost one process start-up, not a compile.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import rank_checks
import torch
import torch.distributed as dist

from sp_lab.compiler import fused_ops
from sp_lab.distributed.collectives import all_gather_single, reduce_scatter_single

TP = 2


def _fused_ops_worker() -> dict[str, Any]:
    """Per rank: max |fused - reference| for both ops at a few shapes, and the uneven-rows error."""
    rank, group_name = dist.get_rank(), dist.group.WORLD.group_name
    out: dict[str, Any] = {"ag_mm": {}, "mm_rs": {}}
    # Every warning the fused ops raise (a deprecated collective's FutureWarning would show in every
    # notebook cell that runs them).
    caught = warnings.catch_warnings(record=True)
    out["warnings"] = warned = caught.__enter__()
    warnings.simplefilter("always")
    for rows, k, n in ((1, 8, 16), (5, 16, 3), (32, 64, 48)):
        # Each rank's shard differs (seeded by rank), the weight is common: as in a column-parallel layer.
        shard = torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + rank))
        weight = torch.randn(k, n, generator=torch.Generator().manual_seed(7))
        gathered = torch.empty(TP * rows, k)
        all_gather_single(gathered, shard)
        fused = torch.ops.sp_lab.fused_all_gather_matmul(shard, weight, group_name, TP)
        out["ag_mm"][rows] = (tuple(fused.shape), (fused - gathered @ weight).abs().max().item())

        a = torch.randn(TP * rows, k, generator=torch.Generator().manual_seed(200 + rank))
        partial = a @ weight
        expected = torch.empty(rows, n)
        reduce_scatter_single(expected, partial)
        fused = torch.ops.sp_lab.fused_matmul_reduce_scatter(a, weight, group_name, TP)
        out["mm_rs"][rows] = (tuple(fused.shape), (fused - expected).abs().max().item())
    try:
        torch.ops.sp_lab.fused_matmul_reduce_scatter(torch.randn(3, 4), torch.randn(4, 4), group_name, TP)
    except ValueError as e:
        out["uneven_error"] = str(e)
    caught.__exit__(None, None, None)
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in warned]
    return out


rank_checks.register(__name__, _fused_ops_worker, timeout=300.0)


@pytest.fixture(scope="module")
def ranks(gloo_checks) -> list[dict[str, Any]]:
    return rank_checks.results_of(gloo_checks, __name__)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_fused_all_gather_matmul_equals_all_gather_then_mm(ranks, rows):
    for result in ranks:
        shape, err = result["ag_mm"][rows]
        assert shape[0] == TP * rows
        assert err < 1e-5


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_fused_matmul_reduce_scatter_equals_mm_then_reduce_scatter(ranks, rows):
    for result in ranks:
        shape, err = result["mm_rs"][rows]
        assert shape[0] == rows
        assert err < 1e-4


def test_fused_matmul_reduce_scatter_names_uneven_rows(ranks):
    for result in ranks:
        assert "3 rows" in result["uneven_error"] and "pads" in result["uneven_error"]


def test_fused_ops_warn_nothing(ranks):
    for result in ranks:
        assert result["warnings"] == []


def test_fake_implementations_give_the_output_shapes():
    a, b = torch.empty(6, 8, device="meta"), torch.empty(8, 5, device="meta")
    # The group is never resolved by the fake kernels, so any name will do.
    assert torch.ops.sp_lab.fused_all_gather_matmul(a, b, "unused", 4).shape == (24, 5)
    assert torch.ops.sp_lab.fused_matmul_reduce_scatter(a, b, "unused", 2).shape == (3, 5)


def test_symm_mem_kernels_are_not_claimed_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the probe may legitimately be True")
    assert fused_ops.symm_mem_ops_available() is False
