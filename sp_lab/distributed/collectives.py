"""Process-group helpers the compiler and models share: the fake group, group names, symmetric memory.

- :func:`fake_process_group` initialises PyTorch's "fake" backend in this one process, so a model for any
  tp size can be traced and compiled (graphs, op counts) without running a collective. Collectives
  return placeholder data: use it for graphs, never for numbers.
- :func:`tp_group_name` gives the name functional collectives and the symm_mem fused ops take.
- :func:`maybe_enable_symm_mem` switches symmetric memory on for a group when the machine allows it and
  says why not otherwise; without it PyTorch's AsyncTP fusion silently does nothing (torch 2.11-2.14).
- :func:`device_for_rank` picks the device a rank computes on.
- :data:`all_gather_single` / :data:`reduce_scatter_single`: the eager dim-0 collectives under their
  current names (torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` with a
  FutureWarning; 2.11 has only the old names).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_single",
    "device_for_rank",
    "fake_process_group",
    "maybe_enable_symm_mem",
    "reduce_scatter_single",
    "tp_group_name",
]

# Chosen once: the new names where this torch has them (no FutureWarning in every notebook cell),
# the old ones on torch 2.11-2.12, where they are not deprecated. Same signatures.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_single(output [tp*c, ...], input [c, ...], group=None, async_op=False)``."""
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter_single(output [M/tp, ...], input [M, ...], op=SUM, group=None, async_op=False)``."""


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Initialise the default group with PyTorch's fake backend for the ``with`` block; yields WORLD.

    The group reports ``world_size`` ranks and this process is ``rank`` among them, but no other process
    exists: collectives return without communicating. Used to trace and compile a ``tp_size``-way model
    (e.g. a 70B-shaped one on the meta device) in one process. The group is destroyed on exit.

    Raises RuntimeError if a process group is already initialised (e.g. inside a rank of
    :func:`sp_lab.launch`), ValueError for a bad ``world_size`` / ``rank``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (the tp size to fake), got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be an int in [0, {world_size - 1}] for world_size={world_size}, got {rank!r}"
        )
    if dist.is_initialized():
        raise RuntimeError(
            f"a process group is already initialised here (backend {dist.get_backend()!r}, world_size "
            f"{dist.get_world_size()}); fake_process_group needs a process without one. Use it outside "
            "sp_lab.launch ranks, or call torch.distributed.destroy_process_group() first."
        )
    # Importing the module registers the "fake" backend (it is not registered by default).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _require_group(group: dist.ProcessGroup | None, what: str) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs an initialised process group: run inside sp_lab.launch(...), under torchrun "
            "after sp_lab.distributed.init_from_env(), or inside fake_process_group(tp_size)."
        )
    return group if group is not None else dist.group.WORLD


def tp_group_name(group: dist.ProcessGroup | None = None) -> str:
    """Name of ``group`` (default: WORLD) as functional collectives and ``symm_mem`` fused ops expect it."""
    return _require_group(group, "tp_group_name").group_name


def maybe_enable_symm_mem(group: dist.ProcessGroup | None = None) -> tuple[bool, str]:
    """Enable symmetric memory for ``group`` (default WORLD) if this machine can use it.

    Returns ``(True, reason)`` once enabled, or ``(False, reason)`` naming what is missing: no process
    group, no CUDA, a backend other than NCCL, world_size 1, or a torch without symmetric memory.
    Never raises for an unsuitable machine: callers fall back to unfused collectives and show the reason.

    Why the deprecated call: on torch 2.11-2.14 ``enable_symm_mem_for_group`` is deprecated but still
    required; without it ``is_symm_mem_enabled_for_group`` stays False and Inductor's micro-pipeline TP
    pass silently leaves the collectives unfused (pytorch issue #193027).
    """
    if not dist.is_initialized():
        return False, "no process group is initialised"
    group = _require_group(group, "maybe_enable_symm_mem")
    backend = str(dist.get_backend(group))
    world_size = dist.get_world_size(group)
    if not torch.cuda.is_available():
        return False, "no CUDA device: symmetric memory and the fused symm_mem kernels exist only on GPUs"
    if backend != "nccl":
        return False, f"the group's backend is {backend!r}; symmetric memory needs an NCCL group"
    if world_size == 1:
        return False, "world_size is 1: there is no communication to overlap"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as error:
        return False, f"torch {torch.__version__} has no symmetric memory module ({error})"
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    is_enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    if enable is None:
        return False, f"torch {torch.__version__} has no enable_symm_mem_for_group"
    # NVLink multicast stays off (see sp_lab.distributed.launch); set before the first allocation.
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    name = group.group_name
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            enable(name)
    except Exception as error:  # noqa: BLE001 - e.g. a driver without P2P / IPC support: report, fall back
        return False, f"enable_symm_mem_for_group({name!r}) failed: {type(error).__name__}: {error}"
    if is_enabled is not None and not is_enabled(name):
        return False, f"enable_symm_mem_for_group({name!r}) returned but the group is still not enabled"
    return True, f"symmetric memory enabled for group {name!r} (world_size {world_size}, NCCL)"


def device_for_rank(rank: int) -> torch.device:
    """The device rank ``rank`` of this machine computes on.

    ``cuda:rank`` (modulo the visible GPUs) when CUDA is available and the group, if any, is NCCL;
    the CPU otherwise: a gloo or fake group on a GPU machine still computes on the CPU, matching
    what :func:`sp_lab.launch` set up.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if dist.is_initialized() and str(dist.get_backend()) != "nccl":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())
