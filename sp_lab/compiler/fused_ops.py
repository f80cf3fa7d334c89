"""Fused collective + matmul ops that the AsyncTP pass emits.

On CUDA the pass emits PyTorch's symmetric-memory kernels (``torch.ops.symm_mem.fused_all_gather_matmul`` and
``torch.ops.symm_mem.fused_matmul_reduce_scatter``), which pipeline chunk matmuls with peer-to-peer copies over
NVLink. Those kernels have no CPU implementation (docs/sp-and-async-tp.md), so for gloo ranks this module
registers two ops of its own with the same semantics:

- ``sp_lab::fused_all_gather_matmul(a [c, K], b [K, N]) -> [tp*c, N]``: ``all_gather(a, dim 0) @ b``
- ``sp_lab::fused_matmul_reduce_scatter(a [M, K], b [K, N]) -> [M/tp, N]``: ``reduce_scatter(a @ b, dim 0)``

and their FP8 forms (``sp_lab::fused_all_gather_scaled_matmul``, ``sp_lab::fused_scaled_matmul_reduce_scatter``,
``torch._scaled_mm`` per chunk, at the end of this file). They are chunked the way the CUDA kernels are (one chunk of rows per rank) and overlap what gloo lets them
overlap: the local chunk's matmul runs while the all_gather is in flight, and each reduce-scatter chunk is
sent (``dist.reduce`` to its owner) as soon as its matmul is done. They exist so the whole pipeline runs and
is tested without a GPU; gloo on 2 cores is a correctness path, not a speed claim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from sp_lab.distributed.collectives import all_gather_single

__all__ = [
    "fused_all_gather_matmul",
    "fused_all_gather_scaled_matmul",
    "fused_matmul_reduce_scatter",
    "fused_scaled_matmul_reduce_scatter",
    "symm_mem_ops_available",
]


def symm_mem_ops_available() -> bool:
    """True when this torch build has the CUDA symmetric-memory fused kernels."""
    try:
        import torch.distributed._symmetric_memory
    except ImportError:
        return False
    return hasattr(torch.ops.symm_mem, "fused_all_gather_matmul") and torch.cuda.is_available()


@torch.library.custom_op("sp_lab::fused_all_gather_matmul", mutates_args=())
def fused_all_gather_matmul(a: torch.Tensor, b: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """``all_gather(a, dim=0) @ b`` with the local chunk's matmul overlapping the gather.

    a: [c, K] this rank's token shard; b: [K, N]; returns [group_size * c, N] in rank order.
    """
    group = _resolve_process_group(group_name)
    rank = dist.get_rank(group)
    c = a.shape[0]
    gathered = a.new_empty((group_size * c, a.shape[1]))
    work = all_gather_single(gathered, a.contiguous(), group=group, async_op=True)
    out = a.new_empty((group_size * c, b.shape[1]))
    torch.mm(a, b, out=out[rank * c : (rank + 1) * c])
    work.wait()
    for peer in range(group_size):
        if peer != rank:
            torch.mm(gathered[peer * c : (peer + 1) * c], b, out=out[peer * c : (peer + 1) * c])
    return out


@fused_all_gather_matmul.register_fake
def _(a, b, group_name, group_size):
    return a.new_empty((group_size * a.shape[0], b.shape[1]))


@torch.library.custom_op("sp_lab::fused_matmul_reduce_scatter", mutates_args=())
def fused_matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    """``reduce_scatter(a @ b, dim=0, sum)``: each row chunk is reduced to its owner as soon as it is computed.

    a: [M, K] with M divisible by group_size (the SP pass pads); b: [K, N]; returns [M / group_size, N].
    """
    return _reduce_scatter_chunks("fused_matmul_reduce_scatter", a.shape[0], group_name, group_size,
                                  lambda lo, hi: torch.mm(a[lo:hi], b))


def _reduce_scatter_chunks(op: str, rows: int, group_name: str, group_size: int,
                           matmul_rows: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """The reduce-scatter pipeline of both fused ops: ``matmul_rows(lo, hi)`` computes rows ``lo:hi`` of the
    product; each chunk is reduced to its owner as soon as it is computed; returns this rank's chunk."""
    group = _resolve_process_group(group_name)
    rank = dist.get_rank(group)
    if rows % group_size:
        raise ValueError(
            f"{op}: {rows} rows do not split into {group_size} equal chunks; "
            "the sequence-parallel pass pads the token dimension to a multiple of tp before this op"
        )
    c = rows // group_size
    chunks, works = [], []
    # Collectives on one group must be issued in the same order on every rank, so chunks go in owner order;
    # chunk i+1's matmul overlaps chunk i's reduction.
    for owner in range(group_size):
        chunk = matmul_rows(owner * c, (owner + 1) * c)
        works.append(dist.reduce(chunk, dst=dist.get_global_rank(group, owner), group=group, async_op=True))
        chunks.append((owner, chunk))
    for work in works:
        work.wait()
    return next(chunk for owner, chunk in chunks if owner == rank)


@fused_matmul_reduce_scatter.register_fake
def _(a, b, group_name, group_size):
    return a.new_empty((a.shape[0] // group_size, b.shape[1]))


# -- scaled (FP8) matmuls -------------------------------------------------------------------------------------
# The same two fusions for ``torch._scaled_mm``, with the semantics of PyTorch's ``fused_all_gather_scaled_matmul``
# / ``fused_scaled_matmul_reduce_scatter``: a row-wise scale ``[rows, 1]`` travels with its rows, a tensor-wise
# scale ``[]`` applies to every chunk. FP8 values cross gloo as bytes (gloo has no float8 type).


def _scale_rows(scale: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The scale of rows ``[start, stop)``: a row-wise scale's slice, a tensor-wise scale itself.

    Row-wise slices are re-viewed with stride ``(1, 1)``: Inductor may hand a ``[c, 1]`` scale over with any
    stride in its size-1 dimension, and ``_scaled_mm`` refuses ``stride(1) != 1``.
    """
    return scale[start:stop].flatten().unsqueeze(1) if scale.dim() == 2 else scale


@torch.library.custom_op("sp_lab::fused_all_gather_scaled_matmul", mutates_args=())
def fused_all_gather_scaled_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    group_name: str,
    group_size: int,
) -> torch.Tensor:
    """``_scaled_mm(all_gather(a), b, all_gather(a_scale) or a_scale, b_scale, bias)``, local chunk first.

    a: [c, K] float8 shard; a_scale: [c, 1] (row-wise, gathered with a) or [] (tensor-wise); b: [K, N] float8
    (column-major); b_scale: [1, N] or []; returns [group_size * c, N] in ``out_dtype``, rank order.
    """
    group = _resolve_process_group(group_name)
    rank = dist.get_rank(group)
    c, rowwise = a.shape[0], a_scale.dim() == 2
    gathered = torch.empty((group_size * c, a.shape[1]), dtype=torch.uint8, device=a.device)
    works = [all_gather_single(gathered, a.contiguous().view(torch.uint8), group=group, async_op=True)]
    scales = a_scale
    if rowwise:
        scales = a_scale.new_empty((group_size * c, 1))
        works.append(all_gather_single(scales, a_scale.contiguous(), group=group, async_op=True))
    out = torch.empty((group_size * c, b.shape[1]), dtype=out_dtype, device=a.device)

    def chunk_mm(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(rows, b, scale, b_scale, bias=bias, out_dtype=out_dtype)

    out[rank * c : (rank + 1) * c] = chunk_mm(a, _scale_rows(a_scale, 0, c))
    for work in works:
        work.wait()
    values = gathered.view(a.dtype)
    for peer in range(group_size):
        if peer != rank:
            out[peer * c : (peer + 1) * c] = chunk_mm(values[peer * c : (peer + 1) * c],
                                                       _scale_rows(scales, peer * c, (peer + 1) * c))
    return out


@fused_all_gather_scaled_matmul.register_fake
def _(a, b, a_scale, b_scale, bias, out_dtype, group_name, group_size):
    return a.new_empty((group_size * a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("sp_lab::fused_scaled_matmul_reduce_scatter", mutates_args=())
def fused_scaled_matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    group_name: str,
    group_size: int,
) -> torch.Tensor:
    """``reduce_scatter(_scaled_mm(a, b, a_scale, b_scale), dim=0, sum)``, chunk by chunk as in
    :func:`fused_matmul_reduce_scatter`.

    a: [M, K] float8, M divisible by group_size; a_scale: [M, 1] or []; returns [M / group_size, N] in
    ``out_dtype``.
    """
    return _reduce_scatter_chunks(
        "fused_scaled_matmul_reduce_scatter", a.shape[0], group_name, group_size,
        lambda lo, hi: torch._scaled_mm(a[lo:hi], b, _scale_rows(a_scale, lo, hi), b_scale, out_dtype=out_dtype))


@fused_scaled_matmul_reduce_scatter.register_fake
def _(a, b, a_scale, b_scale, out_dtype, group_name, group_size):
    return a.new_empty((a.shape[0] // group_size, b.shape[1]), dtype=out_dtype)
