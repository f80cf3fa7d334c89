"""What will really run here (:class:`EffectiveConfig`), checked against this process.

The requested and the effective configuration are kept apart on purpose: vLLM once echoed
``fuse_gemm_comms=true`` and then ran with it off, silently (docs/vllm-config.md). Here
:func:`enable_sp_and_async_tp` returns what will run, with one reason for every requested feature it
dropped or changed, and the compile report shows both side by side.

torch is imported inside the steps of :func:`enable_sp_and_async_tp` only, so importing this module stays cheap.
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
    """SP is applied (in ranges at or above ``LabConfig.sp_start``: ``sp_min_tokens``, else ``async_tp_min_tokens``)."""
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
    sp_lab's chunked reference ops (CPU; a correctness path: they overlap only what gloo lets them), or none."""
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

    The steps, in order: what this process is (:func:`_this_process`), SP and AsyncTP dropped where there is
    nothing to rewrite (:func:`_drop_without_collectives`), the fused ops AsyncTP can insert here
    (:func:`_choose_fused_ops`), CUDA graphs where they can be captured (:func:`_keep_cudagraphs`).
    """
    process = _this_process(config, group)
    wanted = _Wanted(sp=config.enable_sp, async_tp=config.enable_async_tp)
    _drop_without_collectives(config, process, wanted)
    fused_op_impl, symm_mem = _choose_fused_ops(process, group, wanted)
    cudagraphs = _keep_cudagraphs(config, process, wanted)
    notes = config.notes()
    if process.shared_gpu is not None:
        notes.append(_rehearsal_note(process.tp_size, process.device))
    return EffectiveConfig(
        enable_sp=wanted.sp,
        enable_async_tp=wanted.async_tp,
        reasons=wanted.reasons,
        backend=process.backend,
        device=process.device,
        fused_op_impl=fused_op_impl,
        symm_mem=symm_mem,
        cudagraphs=cudagraphs,
        cudagraph_mode=config.cudagraph_mode if cudagraphs else "none",
        tp_size=process.tp_size,
        notes=notes,
        rehearsal=process.shared_gpu is not None,
    )


@dataclasses.dataclass(frozen=True)
class _Process:
    """This process as the compiler will see it."""

    initialised: bool
    """A torch.distributed process group exists."""
    backend: str
    """``"gloo"``, ``"nccl"``, ``"fake"`` or ``"none"``."""
    tp_size: int
    device: str
    shared_gpu: Any = None
    """The one GPU every rank uses in rehearsal mode (gloo ranks sharing a GPU), else None."""


@dataclasses.dataclass
class _Wanted:
    """The features still on, and why each dropped one was dropped (filled step by step)."""

    sp: bool
    async_tp: bool
    reasons: list[str] = dataclasses.field(default_factory=list)

    def drop_sp_and_async_tp(self, why: str) -> None:
        if self.sp:
            self.reasons.append(f"enable_sp: {why}")
        if self.async_tp:
            self.reasons.append(f"enable_async_tp: {why}")
        self.sp = self.async_tp = False

    def drop_async_tp(self, why: str) -> None:
        self.async_tp = False
        self.reasons.append(f"enable_async_tp: {why}")


def _this_process(config: LabConfig, group: Any) -> _Process:
    """Backend, world size (which must be ``config.tp_size``), device, and the rehearsal GPU if any."""
    import torch
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if group is not None and not initialised:
        raise ConfigError(
            "group was given but torch.distributed is not initialised; call init_process_group first"
        )
    if not initialised:
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return _Process(initialised=False, backend="none", tp_size=1, device=device)
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
    elif backend == "nccl" or (backend != "gloo" and torch.cuda.is_available()):
        device = f"cuda:{torch.cuda.current_device()}"
    else:
        device = "cpu"
    return _Process(initialised=True, backend=backend, tp_size=tp_size, device=device, shared_gpu=shared_gpu)


def _drop_without_collectives(config: LabConfig, process: _Process, wanted: _Wanted) -> None:
    """SP and AsyncTP rewrite collectives: none without a process group or with one rank."""
    if not process.initialised and config.tp_size > 1:
        wanted.drop_sp_and_async_tp(
            f"no process group is initialised (tp_size={config.tp_size} requested): run under "
            f"sp_lab.launch(..., world_size={config.tp_size}) or inside "
            f"sp_lab.distributed.collectives.fake_process_group({config.tp_size})"
        )
    elif process.tp_size == 1:
        wanted.drop_sp_and_async_tp("tp_size 1: no collectives to rewrite")
    if wanted.sp and process.backend == "fake":
        wanted.reasons.append(
            "enable_sp: fake process group: SP and AsyncTP are kept so graphs can be traced and inspected, "
            "but collectives return placeholder data -- use the results for graphs, never for numbers"
        )


def _choose_fused_ops(process: _Process, group: Any, wanted: _Wanted) -> tuple[str, bool]:
    """``(fused_op_impl, symm_mem)``: the kernels AsyncTP inserts on this backend (AsyncTP dropped if none)."""
    if not wanted.async_tp:
        return "none", False
    # NCCL ranks and rehearsal ranks (gloo, one shared GPU) both run PyTorch's symmetric-memory kernels.
    if process.backend == "nccl" or process.shared_gpu is not None:
        symm_mem, why = _maybe_enable_symm_mem(group)
        if symm_mem:
            return "symm_mem", True
        which = "rehearsal" if process.shared_gpu is not None else "TP"
        wanted.drop_async_tp(f"symmetric memory unavailable for the {which} group: {why}")
        return "none", False
    if process.backend in ("fake", "gloo"):
        if process.backend == "gloo":
            wanted.reasons.append(
                "enable_async_tp: gloo has no symmetric memory: AsyncTP runs sp_lab's CPU chunked fused "
                "ops, a correctness path that overlaps only what gloo lets it -- time it on NCCL"
            )
        return "cpu_chunked", False
    wanted.drop_async_tp(
        f"backend {process.backend!r} has no fused-op implementation in sp_lab "
        "(supported: nccl with symmetric memory, gloo, fake)"
    )
    return "none", False


def _keep_cudagraphs(config: LabConfig, process: _Process, wanted: _Wanted) -> bool:
    """CUDA graphs stay on where there is CUDA work to capture and nothing uncapturable in it."""
    import torch

    if not config.cudagraphs:
        return False
    if not torch.cuda.is_available():
        why = f"CUDA is not available (torch {torch.__version__}): pieces run without CUDA graphs"
    elif process.shared_gpu is not None and process.tp_size > 1:
        why = "rehearsal mode: gloo collectives run on the host and cannot be captured in CUDA graphs"
    elif not process.device.startswith("cuda"):
        why = f"the model runs on {process.device} (backend {process.backend}); CUDA graphs capture CUDA work only"
    else:
        return True
    wanted.reasons.append(f"cudagraphs: {why}")
    return False


def _maybe_enable_symm_mem(group: Any) -> tuple[bool, str]:
    from sp_lab.distributed.collectives import maybe_enable_symm_mem

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
