"""What will really run here (:class:`EffectiveConfig`), checked against this process.

The requested and the effective configuration are kept apart on purpose: vLLM once echoed
``fuse_gemm_comms=true`` and then ran with it off, silently (docs/vllm-config.md). Here
:func:`enable_sp_and_async_tp` returns what will run, with one reason for every requested feature it
dropped or changed, and the compile report shows both side by side.

torch is imported inside :func:`enable_sp_and_async_tp` only, so importing this module stays cheap.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal

from sp_lab.config import ConfigError

if TYPE_CHECKING:
    from sp_lab.config import LabConfig

__all__ = ["EffectiveConfig", "enable_sp_and_async_tp"]


# -- what will really run ------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class EffectiveConfig:
    """What :func:`enable_sp_and_async_tp` found will really run in this process."""

    enable_sp: bool
    """SP is applied (in ranges at or above ``async_tp_min_tokens``)."""
    enable_async_tp: bool
    """AsyncTP fusion is applied (in SP ranges, subject to the heuristic)."""
    reasons: list[str]
    """One ``"<field>: <why>"`` line for every requested feature that was dropped or changed."""
    backend: str
    """Process-group backend: ``"gloo"``, ``"nccl"``, ``"fake"`` or ``"none"`` (no group)."""
    device: str
    """Device the model runs on: ``"cpu"`` or ``"cuda:<index>"``."""
    fused_op_impl: Literal["symm_mem", "cpu_chunked", "none"]
    """Fused-op implementation AsyncTP inserts: PyTorch's symmetric-memory kernels (CUDA),
    sp_lab's chunked reference ops (CPU; a correctness path, no overlap), or none."""
    symm_mem: bool
    """Symmetric memory is enabled for the TP group."""
    cudagraphs: bool
    """CUDA graphs are captured."""
    cudagraph_mode: str = "none"
    """The ``LabConfig.cudagraph_mode`` that runs: the requested one, or ``"none"`` where graphs were dropped."""
    tp_size: int
    """Ranks in the TP group (1 without a process group)."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """Requested settings that are valid but have no effect (:meth:`LabConfig.notes`), and in rehearsal
    mode the note that the ranks share one GPU."""
    rehearsal: bool = False
    """The ranks share one GPU (``sp_lab.distributed.rehearse_on_one_gpu``): real kernels and numerics,
    not multi-GPU latencies; rows measured so carry ``source="rehearsal"``."""

    def to_dict(self) -> dict[str, Any]:
        """All fields as plain JSON types."""
        return dataclasses.asdict(self)


def enable_sp_and_async_tp(config: LabConfig, group: Any = None) -> EffectiveConfig:
    """Check ``config`` against this process (torch.distributed, CUDA) and return what will run.

    ``group``: the TP process group (default: WORLD). A world size that differs from
    ``config.tp_size`` raises :class:`ConfigError`; every other shortfall drops the feature and says why.
    Under an NCCL group with AsyncTP requested this enables symmetric memory for the group.
    """
    import torch
    import torch.distributed as dist

    reasons: list[str] = []
    notes = config.notes()
    shared_gpu = None  # the one GPU every rank uses in rehearsal mode
    sp, async_tp = config.enable_sp, config.enable_async_tp

    def drop_sp_and_async_tp(why: str) -> None:
        nonlocal sp, async_tp
        if sp:
            reasons.append(f"enable_sp: {why}")
        if async_tp:
            reasons.append(f"enable_async_tp: {why}")
        sp = async_tp = False

    initialised = dist.is_available() and dist.is_initialized()
    if group is not None and not initialised:
        raise ConfigError(
            "group was given but torch.distributed is not initialised; call init_process_group first"
        )

    if not initialised:
        backend, tp_size = "none", 1
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        if config.tp_size == 1:
            drop_sp_and_async_tp("tp_size 1: no collectives to rewrite")
        else:
            drop_sp_and_async_tp(
                f"no process group is initialised (tp_size={config.tp_size} requested): run under "
                f"sp_lab.launch(..., world_size={config.tp_size}) or inside "
                f"sp_lab.distributed.collectives.fake_process_group({config.tp_size})"
            )
    else:
        tp_size = dist.get_world_size(group)
        if tp_size != config.tp_size:
            raise ConfigError(
                f"tp_size: config asks for {config.tp_size} ranks but the process group has {tp_size}; "
                f"set LabConfig(tp_size={tp_size}) or launch {config.tp_size} ranks"
            )
        backend = _backend_name(dist.get_backend(group), cuda=torch.cuda.is_available())
        shared_gpu = _rehearsal_device(group) if backend == "gloo" else None
        if shared_gpu is not None:
            device = str(shared_gpu)
            notes.append(_rehearsal_note(tp_size, device))
        elif backend == "nccl" or (backend != "gloo" and torch.cuda.is_available()):
            device = f"cuda:{torch.cuda.current_device()}"
        else:
            device = "cpu"
        if tp_size == 1:
            drop_sp_and_async_tp("tp_size 1: no collectives to rewrite")

    fused_op_impl, symm_mem = "none", False
    if sp and backend == "fake":
        reasons.append(
            "enable_sp: fake process group: SP and AsyncTP are kept so graphs can be traced and inspected, "
            "but collectives return placeholder data -- use the results for graphs, never for numbers"
        )
    if async_tp:
        # NCCL ranks and rehearsal ranks (gloo, one shared GPU) both run PyTorch's symmetric-memory kernels.
        if backend == "nccl" or shared_gpu is not None:
            symm_mem, why = _maybe_enable_symm_mem(group)
            if symm_mem:
                fused_op_impl = "symm_mem"
            else:
                async_tp = False
                which = "rehearsal" if shared_gpu is not None else "TP"
                reasons.append(f"enable_async_tp: symmetric memory unavailable for the {which} group: {why}")
        elif backend in ("fake", "gloo"):
            fused_op_impl = "cpu_chunked"
            if backend == "gloo":
                reasons.append(
                    "enable_async_tp: gloo has no symmetric memory: AsyncTP runs sp_lab's CPU chunked fused "
                    "ops, a correctness path with no communication/compute overlap -- time it on NCCL"
                )
        else:
            async_tp = False
            reasons.append(
                f"enable_async_tp: backend {backend!r} has no fused-op implementation in sp_lab "
                "(supported: nccl with symmetric memory, gloo, fake)"
            )

    cudagraphs = config.cudagraphs
    if cudagraphs and not torch.cuda.is_available():
        cudagraphs = False
        reasons.append(
            f"cudagraphs: CUDA is not available (torch {torch.__version__}): pieces run without CUDA graphs"
        )
    elif cudagraphs and shared_gpu is not None and tp_size > 1:
        cudagraphs = False
        reasons.append(
            "cudagraphs: rehearsal mode: gloo collectives run on the host and cannot be captured in CUDA graphs"
        )
    elif cudagraphs and not device.startswith("cuda"):
        cudagraphs = False
        reasons.append(
            f"cudagraphs: the model runs on {device} (backend {backend}); CUDA graphs capture CUDA work only"
        )

    return EffectiveConfig(
        enable_sp=sp,
        enable_async_tp=async_tp,
        reasons=reasons,
        backend=backend,
        device=device,
        fused_op_impl=fused_op_impl,
        symm_mem=symm_mem,
        cudagraphs=cudagraphs,
        cudagraph_mode=config.cudagraph_mode if cudagraphs else "none",
        tp_size=tp_size,
        notes=notes,
        rehearsal=shared_gpu is not None,
    )


def _maybe_enable_symm_mem(group: Any) -> tuple[bool, str]:
    # Imported lazily: the distributed layer may not be installed in every checkout of this module's
    # callers, and a missing helper must read as "unavailable, because ..." rather than a crash.
    try:
        from sp_lab.distributed.collectives import maybe_enable_symm_mem
    except ImportError as e:
        return False, f"sp_lab.distributed.collectives.maybe_enable_symm_mem cannot be imported ({e})"
    return maybe_enable_symm_mem(group)


def _rehearsal_device(group: Any) -> Any:
    from sp_lab.distributed.collectives import rehearsal_device

    return rehearsal_device(group)


def _rehearsal_note(world_size: int, device: str) -> str:
    from sp_lab.distributed.collectives import REHEARSAL_NOTE

    return REHEARSAL_NOTE.format(world_size=world_size, device=device)


def _backend_name(raw: Any, *, cuda: bool) -> str:
    """``"gloo"``/``"nccl"``/``"fake"`` from ``dist.get_backend``, resolving ``"cpu:gloo,cuda:nccl"`` by device."""
    name = str(raw).lower()
    if ":" not in name:
        return name
    by_device = dict(part.split(":", 1) for part in name.split(","))
    return by_device.get("cuda" if cuda and "cuda" in by_device else "cpu", name)
