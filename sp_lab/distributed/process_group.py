"""Backend choice and process-group initialisation, shared by :func:`sp_lab.launch`'s ranks and torchrun.

:func:`init_from_env` / :func:`run_under_torchrun` run the same function under torchrun that
:func:`sp_lab.launch` runs from a notebook.
"""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "RANK_ENV_DEFAULTS",
    "RankInfo",
    "cpu_threads_per_rank",
    "init_from_env",
    "init_process_group",
    "resolve_backend",
    "run_under_torchrun",
]

# Environment every rank gets before the process group exists. setdefault, so a user who knows better can
# still change each.
# - NVLink multicast (NVLS) is kept off: it needs fabric-manager support that lent and shared machines often
#   lack, and symmetric memory falls back to it silently.
# - init_process_group returns only once every rank has formed the group (torch's store-based barrier, off by
#   default). gloo's mesh can be complete on one rank while a peer still reads its end of the handshake; a rank
#   whose function needs no collective then finished, exited and closed its connections, and the peer failed
#   with "Connection closed by peer" (seen under load on 2 cores, on both starts of one launch).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
RANK_ENV_DEFAULTS = {**MULTICAST_OFF, "TORCH_DIST_INIT_BARRIER": "1"}

# Backends a rank of launch() cannot use, and what to do instead.
_UNLAUNCHABLE = {
    "fake": "the fake backend runs in one process; use sp_lab.distributed.collectives.fake_process_group",
    "undefined": "'undefined' is a placeholder, not a backend",
}


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job, as seen after the process group is initialised."""

    rank: int
    """Global rank of this process, 0..world_size-1."""
    world_size: int
    """Number of ranks in the default group."""
    local_rank: int
    """Rank among the processes of this machine; selects the GPU with NCCL."""
    backend: str
    """The process group's backend: "gloo", "nccl", ..."""
    device: torch.device
    """The device this rank should compute on: cuda:local_rank with NCCL, cpu otherwise."""


def _known_backends() -> list[str]:
    return [b for b in dist.Backend.backend_list if b not in _UNLAUNCHABLE]


def resolve_backend(backend: str, world_size: int) -> str:
    """Turn ``backend`` ("auto", "gloo", "nccl", ...) into one that can run ``world_size`` ranks here.

    "auto" picks NCCL when CUDA and NCCL are present and there is one GPU per rank, else gloo (with a
    warning when some GPUs exist but too few). Raises ValueError naming the bad value and what would
    work: a backend unknown to this torch, one not built into it, or NCCL with more ranks than GPUs.
    ``world_size`` counts the ranks of *this machine* (torchrun's LOCAL_WORLD_SIZE).
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string such as 'auto', 'gloo' or 'nccl', got {backend!r}")
    name = backend.lower()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        if gpus >= world_size and dist.is_nccl_available():
            return "nccl"
        if gpus >= world_size:
            warnings.warn(
                f"backend='auto' with {gpus} GPU(s) but this torch has no NCCL: using gloo on the CPU. Install a "
                "torch built with NCCL to run the ranks on the GPUs.",
                stacklevel=3,
            )
        elif gpus:
            warnings.warn(
                f"backend='auto' with world_size={world_size} but only {gpus} GPU(s) visible: using gloo "
                f"on the CPU. Pass world_size<={gpus} to run on the GPUs with NCCL.",
                stacklevel=3,
            )
        return "gloo"
    if name in _UNLAUNCHABLE:
        raise ValueError(f"backend={backend!r} cannot run ranks: {_UNLAUNCHABLE[name]}")
    known = _known_backends()
    if name not in known:
        raise ValueError(
            f"backend={backend!r} is not known to torch {torch.__version__}; "
            f"known backends: {', '.join(repr(b) for b in ['auto', *known])}"
        )
    available = [b for b in known if dist.is_backend_available(b)]
    # The GPU count first: on a CPU machine "too few GPUs" is the cause worth naming, not the build.
    if name == "nccl" and gpus < world_size:
        fix = f"use world_size<={gpus}, or " if gpus else "use "
        build = "" if dist.is_nccl_available() else f" (and this torch, {torch.__version__}, has no NCCL)"
        raise ValueError(
            f"world_size={world_size} with backend='nccl' needs one GPU per rank, but {gpus} GPU(s) "
            f"are visible{build}; {fix}backend='gloo' (or 'auto') to run the ranks on the CPU"
        )
    if name not in available:
        raise ValueError(
            f"backend={backend!r} is not built into this torch ({torch.__version__}); "
            f"available here: {', '.join(repr(b) for b in ['auto', *available])}"
        )
    return name


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def cpu_threads_per_rank(world_size: int) -> int:
    """Ranks share the machine's cores; oversubscribing them makes CPU collectives crawl."""
    return max(1, _cpu_count() // world_size)


def init_process_group(
    backend: str,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    timeout_s: float,
    store: dist.Store | None = None,
) -> RankInfo:
    """Initialise the default group; ``store=None`` means env:// (MASTER_ADDR/MASTER_PORT, torchrun)."""
    for key, value in RANK_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    device = torch.device("cpu")
    options: dict[str, Any] = {}
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        options["device_id"] = device  # binds the communicator to this GPU up front
    dist.init_process_group(
        backend,
        init_method=None if store is not None else "env://",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **options,
    )
    return RankInfo(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend, device=device)


def _int_env(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is not None:
            return default
        raise RuntimeError(
            f"environment variable {name} is not set: init_from_env() expects torchrun (or another "
            "launcher) to set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. "
            "In a notebook, use sp_lab.launch(fn, world_size=N) instead."
        )
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


def init_from_env(backend: str = "auto", *, timeout: float = 1800.0) -> RankInfo:
    """Initialise the default process group from torchrun's environment (env:// rendezvous).

    Reads RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, picks the backend as :func:`launch` does
    (one GPU per local rank for NCCL), sets the NVLink-multicast-off defaults and, with NCCL, the current
    CUDA device. If a group already exists it is left alone and described. ``timeout`` bounds every
    collective, in seconds.
    """
    if dist.is_initialized():
        backend_now = str(dist.get_backend())
        local_rank = _int_env("LOCAL_RANK", 0)
        device = torch.device("cuda", local_rank) if backend_now == "nccl" else torch.device("cpu")
        return RankInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend_now, device)
    rank, world_size = _int_env("RANK"), _int_env("WORLD_SIZE")
    local_rank = _int_env("LOCAL_RANK", rank)
    local_world_size = _int_env("LOCAL_WORLD_SIZE", world_size)
    resolved = resolve_backend(backend, local_world_size)
    if resolved != "nccl":
        torch.set_num_threads(cpu_threads_per_rank(local_world_size))
    return init_process_group(
        resolved, rank=rank, world_size=world_size, local_rank=local_rank, timeout_s=timeout
    )


def run_under_torchrun(fn: Callable[..., Any], *args: Any, backend: str = "auto", **kwargs: Any) -> Any:
    """Under torchrun: initialise the group from the environment, return ``fn(*args, **kwargs)``, clean up.

    The cluster-side twin of :func:`launch`: the same ``fn`` runs unchanged, but each process returns
    only its own rank's result.
    """
    created = not dist.is_initialized()
    init_from_env(backend)
    try:
        return fn(*args, **kwargs)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
