"""Overlap inside one fused kernel, chunk by chunk: when each chunk's matmul and each copy runs.

A ``tp``-way fused kernel (PyTorch's symmetric-memory ``fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter``) splits the matmul into ``tp`` row chunks and moves one chunk per peer
with copy-engine transfers on a second stream:

- all_gather side (``"ag"``): the local chunk is multiplied first while the copies of the other chunks
  run back to back; chunk ``i`` can start only once its copy has landed. If copies are slower than the
  matmuls, the matmul stream waits (pipeline fill and bubbles).
- reduce_scatter side (``"rs"``): chunk ``i``'s partial result is sent to its owner as soon as it is
  computed, while the next chunk is computed; the local chunk comes last. Whatever copy is still in
  flight after the last matmul is the pipeline's drain.

While a copy runs, the matmul on the same GPU runs slower: copies read and write the same HBM and the
matmul kernels share L2 and memory bandwidth with them. ``contention`` is that slow-down factor (1 = none):
matmul work proceeds at rate ``1 / contention`` whenever a copy is active. The schedule is simulated
exactly as a two-stream event sequence; :class:`PipelineTiming` says where the time went.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_EPS = 1e-9


@dataclass(frozen=True)
class PipelineTiming:
    """Where the time of one fused kernel's chunk pipeline went (all in microseconds)."""

    total_us: float
    """From the first chunk's start to the last matmul or copy's end."""
    compute_us: float
    """The chunk matmuls at full speed (no contention, no waiting)."""
    stall_us: float
    """Matmul stream idle, waiting for a copy (the pipeline fill and any bubble)."""
    contention_us: float
    """Extra matmul time from running alongside copies."""
    drain_us: float
    """After the last matmul, until the last copy lands."""


def run_pipeline(compute_us: Sequence[float], copy_us: Sequence[float], side: str,
                 contention: float = 1.0) -> PipelineTiming:
    """Simulate one fused kernel's chunk pipeline.

    Args:
        compute_us: full-speed matmul time of each chunk, in the order the kernel computes them
            (``"ag"``: local chunk first; ``"rs"``: local chunk last).
        copy_us: one copy per non-local chunk, ``len(compute_us) - 1`` of them: on ``"ag"`` copy ``j``
            brings the input of chunk ``j + 1``; on ``"rs"`` copy ``j`` sends the output of chunk ``j``.
        side: ``"ag"`` or ``"rs"``.
        contention: matmul slow-down while a copy is active (>= 1).
    """
    if side not in ("ag", "rs"):
        raise ValueError(f"side must be 'ag' or 'rs', got {side!r}")
    if len(copy_us) != len(compute_us) - 1:
        raise ValueError(f"need one copy per non-local chunk: {len(compute_us)} chunks, {len(copy_us)} copies")
    if contention < 1 or min([*compute_us, *copy_us], default=0) < 0:
        raise ValueError(f"contention must be >= 1 and times >= 0; got contention={contention}")
    n, m = len(compute_us), len(copy_us)
    t = stall = 0.0
    computed = copied = 0  # chunks / copies finished
    c_left = float(compute_us[0]) if n else 0.0
    k_left = float(copy_us[0]) if m else 0.0
    last_compute_end = 0.0
    while computed < n or copied < m:
        # ag: chunk i needs copy i-1 landed; rs: copy j needs chunk j computed
        compute_on = computed < n and (side == "rs" or computed == 0 or copied >= computed)
        copy_on = copied < m and (side == "ag" or computed > copied)
        if not (compute_on or copy_on):  # cannot happen with valid inputs; guards an endless loop
            raise RuntimeError(f"pipeline deadlock at t={t}: computed={computed}, copied={copied}")
        rate = 1.0 / contention if copy_on else 1.0
        dt = min(c_left / rate if compute_on else float("inf"), k_left if copy_on else float("inf"))
        t += dt
        if compute_on:
            c_left -= dt * rate
        elif computed < n:
            stall += dt
        if copy_on:
            k_left -= dt
        if compute_on and c_left <= _EPS:
            computed += 1
            last_compute_end = t
            c_left = float(compute_us[computed]) if computed < n else 0.0
        if copy_on and k_left <= _EPS:
            copied += 1
            k_left = float(copy_us[copied]) if copied < m else 0.0
    compute = float(sum(compute_us))
    drain = t - last_compute_end
    return PipelineTiming(total_us=t, compute_us=compute, stall_us=stall,
                          contention_us=last_compute_end - compute - stall, drain_us=drain)
