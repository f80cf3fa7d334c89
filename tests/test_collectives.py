"""sp_lab.distributed.collectives: the fake group, group names, symmetric memory, devices."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import sp_lab
from sp_lab.distributed import device_for_rank, fake_process_group, maybe_enable_symm_mem, tp_group_name


# torch 2.13 deprecates reduce_scatter_tensor for reduce_scatter_single, which 2.11 may lack.
@pytest.mark.filterwarnings("ignore:.*reduce_scatter_tensor.*deprecated:FutureWarning")
def test_fake_group_fakes_any_tp_size_in_one_process():
    with fake_process_group(8, rank=3) as group:
        assert group is dist.group.WORLD
        assert (dist.get_world_size(), dist.get_rank()) == (8, 3)
        name = tp_group_name()
        assert isinstance(name, str) and name == tp_group_name(group)
        # Shapes follow the fake tp size (the data is placeholder: graphs, never numbers).
        shard = funcol.reduce_scatter_tensor(torch.ones(16, 4), "sum", 0, name)
        assert funcol.wait_tensor(shard).shape == (2, 4)
        enabled, reason = maybe_enable_symm_mem()
        assert not enabled and reason
    assert not dist.is_initialized()


def test_fake_group_refuses_bad_sizes_and_nesting():
    with pytest.raises(ValueError, match="world_size must be a positive int"), fake_process_group(0):
        pass
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 1\]"), fake_process_group(2, rank=2):
        pass
    with (
        fake_process_group(2),
        pytest.raises(RuntimeError, match="already initialised"),
        fake_process_group(4),
    ):
        pass
    assert not dist.is_initialized()


def test_fake_group_is_destroyed_when_the_block_raises():
    with pytest.raises(KeyError), fake_process_group(4):
        raise KeyError("boom")
    assert not dist.is_initialized()


def test_without_a_group_the_helpers_say_so():
    assert maybe_enable_symm_mem() == (False, "no process group is initialised")
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        tp_group_name()
    with pytest.raises(ValueError, match="rank must be a non-negative int"):
        device_for_rank(-1)


def _symm_mem_and_device() -> tuple:
    return maybe_enable_symm_mem(), device_for_rank(dist.get_rank()), tp_group_name()


def test_gloo_ranks_compute_on_the_cpu_and_skip_symmetric_memory():
    results = sp_lab.launch(_symm_mem_and_device, world_size=2, backend="gloo", timeout=60)
    for (enabled, reason), device, name in results:
        assert not enabled
        # Without CUDA that is the reason; on a GPU machine the gloo backend is.
        assert "no CUDA" in reason or "'gloo'" in reason
        assert device == torch.device("cpu")
        assert isinstance(name, str)


@pytest.mark.multigpu
def test_nccl_ranks_enable_symmetric_memory():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    results = sp_lab.launch(_symm_mem_and_device, world_size=2, backend="nccl", timeout=120)
    for rank, ((enabled, reason), device, _) in enumerate(results):
        assert enabled, reason
        assert device == torch.device("cuda", rank)
