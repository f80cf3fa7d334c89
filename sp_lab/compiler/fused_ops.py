"""Fused collective + matmul ops that the AsyncTP pass emits.

On CUDA the pass emits PyTorch's symmetric-memory kernels (``torch.ops.symm_mem.fused_all_gather_matmul`` and
``torch.ops.symm_mem.fused_matmul_reduce_scatter``), which pipeline chunk matmuls with peer-to-peer copies over
NVLink. Those kernels have no CPU implementation (docs/sp-and-async-tp.md), so for gloo ranks this module
registers two ops of its own with the same semantics:

- ``sp_lab::fused_all_gather_matmul(a [c, K], b [K, N]) -> [tp*c, N]``: ``all_gather(a, dim 0) @ b``
- ``sp_lab::fused_matmul_reduce_scatter(a [M, K], b [K, N]) -> [M/tp, N]``: ``reduce_scatter(a @ b, dim 0)``

They are chunked the way the CUDA kernels are (one chunk of rows per rank) and overlap what gloo lets them
overlap: the local chunk's matmul runs while the all_gather is in flight, and each reduce-scatter chunk is
sent (``dist.reduce`` to its owner) as soon as its matmul is done. They exist so the whole pipeline runs and
is tested without a GPU; gloo on 2 cores is a correctness path, not a speed claim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from sp_lab.distributed.collectives import all_gather_single

__all__ = ["fused_all_gather_matmul", "fused_matmul_reduce_scatter", "symm_mem_ops_available"]


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
    group = _resolve_process_group(group_name)
    rank = dist.get_rank(group)
    if a.shape[0] % group_size:
        raise ValueError(
            f"fused_matmul_reduce_scatter: {a.shape[0]} rows do not split into {group_size} equal chunks; "
            "the sequence-parallel pass pads the token dimension to a multiple of tp before this op"
        )
    c = a.shape[0] // group_size
    chunks, works = [], []
    # Collectives on one group must be issued in the same order on every rank, so chunks go in owner order;
    # chunk i+1's matmul overlaps chunk i's reduction.
    for owner in range(group_size):
        chunk = torch.mm(a[owner * c : (owner + 1) * c], b)
        works.append(dist.reduce(chunk, dst=dist.get_global_rank(group, owner), group=group, async_op=True))
        chunks.append((owner, chunk))
    for work in works:
        work.wait()
    return next(chunk for owner, chunk in chunks if owner == rank)


@fused_matmul_reduce_scatter.register_fake
def _(a, b, group_name, group_size):
    return a.new_empty((a.shape[0] // group_size, b.shape[1]))
