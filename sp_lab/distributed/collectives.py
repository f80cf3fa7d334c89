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
- :func:`rehearse_on_one_gpu` turns a gloo rank into a *rehearsal* rank: every rank computes on the same GPU
  and symmetric memory spans the overlapping devices, so the multi-rank GPU code path (the real
  ``symm_mem`` fused kernels, Inductor's lowering of them, every collective sp_lab emits) runs on a machine
  with one GPU (functional all_gathers take gloo's host-staged path there, see
  ``_install_gloo_cuda_all_gather``). What a rehearsal cannot show: real overlap (the ranks take turns on
  one GPU) and CUDA-graph capture of the collectives (gloo's are not capturable), so its latencies are
  labelled ``rehearsal`` and never tuned on.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

from sp_lab.distributed.process_group import MULTICAST_OFF

__all__ = [
    "REHEARSAL_NOTE",
    "all_gather_single",
    "device_for_rank",
    "fake_process_group",
    "maybe_enable_symm_mem",
    "reduce_scatter_single",
    "rehearsal_device",
    "rehearse_on_one_gpu",
    "tp_group_name",
]

# Chosen once: the new names where this torch has them (no FutureWarning in every notebook cell),
# the old ones on torch 2.11-2.12, where they are not deprecated. Same signatures.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_single(output [tp*c, ...], input [c, ...], group=None, async_op=False)``."""
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``reduce_scatter_single(output [M/tp, ...], input [M, ...], op=SUM, group=None, async_op=False)``."""

REHEARSAL_NOTE = (
    "rehearsal: {world_size} ranks share one GPU ({device}) on a gloo group, with symmetric memory on "
    "overlapping devices; numerics and the fused symm_mem kernels are real, latencies are not multi-GPU "
    "latencies (no real overlap; gloo collectives run outside CUDA graphs)"
)
"""The note an effective config carries in rehearsal mode (``str.format``-ed with world_size and device)."""

# Set by rehearse_on_one_gpu in this process: the one GPU every rank computes on.
_rehearsal_device: torch.device | None = None


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


def rehearse_on_one_gpu(device: int | str | torch.device = 0) -> torch.device:
    """Make this gloo rank a rehearsal rank on ``device``; call in every rank before building the model.

    Every rank of the gloo group then computes on the same GPU, and symmetric memory is allowed to span
    ranks on overlapping devices (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``, set here, before the first
    symmetric-memory rendezvous). :func:`sp_lab.enable_sp_and_async_tp` then reports ``device`` as the
    model's device, ``fused_op_impl="symm_mem"`` and a note that the ranks share one GPU, and
    :func:`device_for_rank` returns ``device``. Typical use::

        def rank_fn():
            device = rehearse_on_one_gpu()
            model = sp_lab.models.build("toy", tp_rank=dist.get_rank(), tp_size=dist.get_world_size(),
                                        device=device)
            ...
        sp_lab.launch(rank_fn, world_size=4, backend="gloo")

    Raises RuntimeError without a gloo group or without CUDA (NCCL refuses two ranks on one GPU:
    "Duplicate GPU detected", which is why the rehearsal runs on gloo), ValueError for a non-CUDA device.
    """
    global _rehearsal_device
    group = _require_group(None, "rehearse_on_one_gpu")
    backend = str(dist.get_backend(group))
    if backend != "gloo":
        raise RuntimeError(
            f"rehearse_on_one_gpu needs a gloo group, this one is {backend!r}: NCCL refuses several ranks on "
            "one GPU. Launch with sp_lab.launch(fn, world_size=N, backend='gloo')."
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"rehearse_on_one_gpu needs a CUDA GPU (torch {torch.__version__} sees none); on a CPU machine run "
            "the gloo ranks on the CPU, where AsyncTP uses sp_lab's chunked reference ops"
        )
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: a rehearsal runs on a CUDA device, got {str(device)!r} (e.g. 0 or 'cuda:0')")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    torch.cuda.set_device(device)
    _install_gloo_cuda_all_gather()
    _rehearsal_device = device
    return device


# Functional all_gathers (what sp_lab's LM head, the SP pass and Inductor emit) reach gloo through
# allgather_into_tensor_coalesced, which treats CUDA pointers as host memory and segfaults (pytorch issue
# #152645; seen here on torch 2.11 for eager and compiled all_gathers, while all_reduce and reduce_scatter
# work). dist.all_gather_into_tensor (all_gather_single) takes gloo's _allgather_base, which stages CUDA tensors through the
# host correctly. Rehearsal ranks therefore get CUDA kernels for the functional all_gather ops that call it;
# its result is complete when returned, so the graph's wait_tensor finds no pending work and passes it on.
_gloo_cuda_all_gather_lib: torch.library.Library | None = None


def _install_gloo_cuda_all_gather() -> None:
    global _gloo_cuda_all_gather_lib
    if _gloo_cuda_all_gather_lib is not None:
        return
    from torch.distributed.distributed_c10d import _resolve_process_group

    def gather_into(out: torch.Tensor, shard: torch.Tensor, group: str | dist.ProcessGroup) -> torch.Tensor:
        # The op's group argument is a name (torch 2.11) or may be the group itself (newer schemas: Any).
        group = group if isinstance(group, dist.ProcessGroup) else _resolve_process_group(group)
        all_gather_single(out, shard.contiguous(), group=group)
        return out

    def all_gather_into_tensor(shard: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
        out = shard.new_empty((shard.shape[0] * group_size, *shard.shape[1:]))
        return gather_into(out, shard, group_name)

    def all_gather_into_tensor_out(shard, group_size, group_name, *, out):
        return gather_into(out, shard, group_name)

    def all_gather_into_tensor_coalesced(shards, group_size, group_name):
        return [all_gather_into_tensor(shard, group_size, group_name) for shard in shards]

    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_gather_into_tensor", all_gather_into_tensor, "CUDA")
    lib.impl("all_gather_into_tensor_out", all_gather_into_tensor_out, "CUDA")
    lib.impl("all_gather_into_tensor_coalesced", all_gather_into_tensor_coalesced, "CUDA")
    _gloo_cuda_all_gather_lib = lib


def rehearsal_device(group: dist.ProcessGroup | None = None) -> torch.device | None:
    """The shared GPU when this process is a rehearsal rank (:func:`rehearse_on_one_gpu`) of a gloo
    ``group`` (default WORLD); ``None`` otherwise (also after the group was destroyed)."""
    if _rehearsal_device is None or not dist.is_initialized():
        return None
    if str(dist.get_backend(group if group is not None else dist.group.WORLD)) != "gloo":
        return None
    return _rehearsal_device


def maybe_enable_symm_mem(group: dist.ProcessGroup | None = None) -> tuple[bool, str]:
    """Enable symmetric memory for ``group`` (default WORLD) if this machine can use it.

    Returns ``(True, reason)`` once enabled, or ``(False, reason)`` naming what is missing: no process
    group, no CUDA, a backend other than NCCL (gloo only in rehearsal mode, :func:`rehearse_on_one_gpu`),
    world_size 1, or a torch without symmetric memory.
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
    rehearsal = rehearsal_device(group) is not None
    if backend != "nccl" and not rehearsal:
        return False, (
            f"the group's backend is {backend!r}; symmetric memory needs an NCCL group (or, with every rank "
            "on one GPU, a gloo group in rehearsal mode: sp_lab.distributed.rehearse_on_one_gpu())"
        )
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
    # Off wherever a rank may touch symmetric memory, before its first allocation.
    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
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
    where = "ranks sharing one GPU, gloo" if rehearsal else "NCCL"
    return True, f"symmetric memory enabled for group {name!r} (world_size {world_size}, {where})"


def device_for_rank(rank: int) -> torch.device:
    """The device rank ``rank`` of this machine computes on.

    ``cuda:rank`` (modulo the visible GPUs) when CUDA is available and the group, if any, is NCCL;
    the shared GPU for a rehearsal rank (:func:`rehearse_on_one_gpu`); the CPU otherwise: a gloo or
    fake group on a GPU machine still computes on the CPU, matching what :func:`sp_lab.launch` set up.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
    shared = rehearsal_device()
    if shared is not None:
        return shared
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if dist.is_initialized() and str(dist.get_backend()) != "nccl":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())
