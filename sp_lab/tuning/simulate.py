"""The earlier, uncalibrated what-if model (rows ``source="simulated"``); the calibrated one is
:mod:`sp_lab.tuning.predict` (chunk pipeline, contention, measured fused-op cost, per-GPU hardware data,
validated against published figures). This module stays for the tuning fixtures and stores that carry
``"simulated"`` rows; its measured tables now live in :mod:`sp_lab.tuning.predict.kernels`.

Until multi-GPU measurements exist, a sweep is *predicted* from two ingredients:

1. **Measured single-GPU matmul times** (:class:`MatmulTable`): one H200, bf16, CUDA-graph replay,
   shipped under ``sp_lab/data/h200/`` with provenance. ``mm`` rows are one ``[M, K] @ [K, N]`` matmul;
   ``mm_chunked`` rows are the same rows split into ``tp`` chunks, which is what a ``tp``-way fused
   kernel computes (its *chunking penalty*, docs/measured-h200.md). Where no chunked row was measured
   for a shape, the chunked time is ``tp`` matmuls of ``M/tp`` rows read off the ``mm`` rows -- the
   shipped tp=8 table agrees with that to within ~15% (tests/test_simulate.py checks it).
2. **An alpha-beta communication model** per interconnect (:class:`AlphaBeta`): a collective on a
   ``[T, H]`` activation of ``S`` bytes over ``tp`` ranks costs ``alpha + f * S / beta`` with the ring
   factors ``f = 2(tp-1)/tp`` (all_reduce) and ``(tp-1)/tp`` (reduce_scatter, all_gather), ``beta``
   the effective bus bandwidth. Defaults for H200 NVLink are *assumptions* with their sources below.

Per decoder layer and token count ``T`` (padded to a multiple of ``tp``), attention excluded (it is
the same in every variant):

- ``baseline``:    4 matmuls on T rows + 2 all_reduce + 2 (add+)norms on T tokens
- ``sp``:          4 matmuls on T rows + 2 reduce_scatter + 2 all_gather + 2 norms on T/tp tokens
- ``sp+async_tp``: per fused pair ``max(chunked matmul, its collective) + sync_us`` + 2 norms on T/tp
- ``tuned``:       as ``sp``, with each matmul fused or not by a :class:`~sp_lab.rules.MatmulRule`

Every row this module returns says ``source="simulated"``; :func:`compare_to_measured` refuses to
mix labels. The model is optimistic for fusion: it assumes perfect overlap inside a fused kernel and
a constant sync cost, while the world_size-1 measurement (``sp_lab/data/h200/symm_mem_ws1.json``, docs/measured-h200.md)
shows the fused kernel costing 1.7-2.2x a plain matmul at M=4096 even with no communication.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import polars as pl

from sp_lab.tuning.microbench import MatmulShape, _spec_dims, padded_tokens, tp_matmul_shapes
from sp_lab.tuning.predict.hardware import RING_FACTORS
from sp_lab.tuning.predict.kernels import (  # noqa: F401  (re-exported: this module's former home of the tables)
    CHUNKING_TP8_JSON,
    SINGLE_GPU_JSON,
    MatmulTable,
    RooflineMatmul,
    fit_roofline,
)
from sp_lab.tuning.predict.layer import num_layers_of
from sp_lab.vocabulary import BASELINE, MEASURED, SIMULATED, SP, SP_ASYNC_TP, TUNED

if TYPE_CHECKING:
    from sp_lab.rules import MatmulRule
    from sp_lab.tuning.microbench import ModelDescription

COLLECTIVE_FACTORS = RING_FACTORS


# ------------------------------------------------------------------------------------ communication


@dataclass(frozen=True)
class AlphaBeta:
    """Alpha-beta cost of ring collectives on one interconnect."""

    name: str
    """Short label carried into every predicted row (``comm_model`` column)."""
    alpha_us: float
    """Fixed cost per collective call (launch + synchronisation + small-message latency), microseconds."""
    beta_gbps: float
    """Effective bus bandwidth per GPU in GB/s (1e9 bytes/s), in NCCL-tests' "busbw" convention."""
    sync_us: float = 3.0
    """Extra cost of one symmetric-memory fused kernel over its overlapped work (barriers, signals)."""
    source: str = ""
    """Where the numbers come from; say "assumption" when they were not measured."""

    def __post_init__(self) -> None:
        if self.alpha_us < 0 or self.beta_gbps <= 0 or self.sync_us < 0:
            raise ValueError(f"AlphaBeta {self.name!r}: need alpha_us >= 0, beta_gbps > 0, sync_us >= 0; got {self}")

    def collective_us(self, kind: str, nbytes: float, tp: int) -> float:
        """Time of collective ``kind`` over ``tp`` ranks on a full (unsharded) tensor of ``nbytes`` bytes.

        For reduce_scatter ``nbytes`` is the input, for all_gather the output: both are ``[T, H]``.
        """
        if kind not in COLLECTIVE_FACTORS:
            raise ValueError(f"unknown collective {kind!r}; expected one of {sorted(COLLECTIVE_FACTORS)}")
        if tp == 1:
            return 0.0
        # bytes / (GB/s) = bytes / (beta * 1e9) s = bytes / (beta * 1e3) us
        return self.alpha_us + COLLECTIVE_FACTORS[kind](tp) * nbytes / (self.beta_gbps * 1e3)


# NVLink 4 on H100/H200 SXM: 18 links x 50 GB/s = 900 GB/s bidirectional per GPU, i.e. 450 GB/s each
# way (NVIDIA H200 datasheet: "NVLink: 900GB/s"). Ring collectives through NCCL reach well below the
# link rate: published nccl-tests all_reduce_perf runs on 8x H100 SXM report bus bandwidths around
# 350-370 GB/s for large messages without NVLink SHARP (NVLS, multicast, which is off on the machines
# this project uses). ASSUMPTIONS, not measured here: beta = 360 GB/s (80% of 450) for all_reduce,
# reduce_scatter and all_gather alike; alpha = 8 us per collective (NCCL small-message latency within
# one NVLink node is of order 5-15 us); sync_us = 3 us from the world_size-1 measurement
# (sp_lab/data/h200/symm_mem_ws1.json, M=8: fused AG+mm 10.4 us vs mm 7.3 us under CUDA graphs).
H200_NVLINK = AlphaBeta(
    name="h200-nvlink4",
    alpha_us=8.0,
    beta_gbps=360.0,
    sync_us=3.0,
    source="assumption: NVLink4 900 GB/s bidir (450/dir, H200 datasheet) at 80% ring efficiency; "
    "alpha 8 us; sync 3 us from h200_symm_mem_ws1.json",
)

# PCIe Gen5 x16: 64 GB/s per direction (PCI-SIG); GPUs without NVLink talk through the host bridge and
# NCCL typically reaches ~40-50 GB/s bus bandwidth there. ASSUMPTION: beta 45 GB/s, alpha 15 us. The
# symm_mem fused kernels need peer access, which PCIe setups often lack: treat async_tp rows as what-if.
PCIE5 = AlphaBeta(
    name="pcie5-x16",
    alpha_us=15.0,
    beta_gbps=45.0,
    sync_us=3.0,
    source="assumption: PCIe Gen5 x16 64 GB/s per direction at ~70% NCCL efficiency; alpha 15 us",
)

INTERCONNECTS = {c.name: c for c in (H200_NVLINK, PCIE5)}


# ---------------------------------------------------------------------------------- per-matmul model


def predict_matmul_rows(
    shapes: Sequence[MatmulShape],
    token_counts: Iterable[int],
    tp: int,
    matmul: MatmulTable | RooflineMatmul,
    *,
    hidden_size: int,
    comm: AlphaBeta = H200_NVLINK,
    dtype_bytes: int = 2,
) -> pl.DataFrame:
    """Predicted fused vs unfused latency of each TP matmul with its collective (training-row layout).

    ``unfused_us = mm(M) + collective(M x hidden)``; ``fused_us = max(chunked mm, collective) + sync_us``.
    Returns ``m, n, k, tp, name, side, unfused_us, fused_us, ratio, mm_us, chunked_us, comm_us,
    chunked_method, comm_model, device_name, source="simulated"``.
    """
    rows = []
    for shape in shapes:
        for m in token_counts:
            m_pad = padded_tokens(m, tp)
            if isinstance(matmul, MatmulTable):
                mm = matmul.mm_us(m_pad, shape.n, shape.k)
                chunked, method = matmul.chunked_us(m_pad, shape.n, shape.k, tp)
                device = matmul.provenance.get("device", "")
            else:
                mm, chunked, method = matmul.mm_us(m_pad, shape.n, shape.k), matmul.chunked_us(
                    m_pad, shape.n, shape.k, tp), "roofline"
                device = f"roofline fit ({matmul.peak_tflops:.0f} TFLOP/s, {matmul.hbm_gbps:.0f} GB/s)"
            comm_us = comm.collective_us(shape.collective, m_pad * hidden_size * dtype_bytes, tp)
            unfused = mm + comm_us
            fused = max(chunked, comm_us) + comm.sync_us
            rows.append({"m": m, "n": shape.n, "k": shape.k, "tp": tp, "name": shape.name, "side": shape.side,
                         "unfused_us": unfused, "fused_us": fused, "ratio": fused / unfused, "mm_us": mm,
                         "chunked_us": chunked, "comm_us": comm_us, "chunked_method": method,
                         "comm_model": comm.name, "device_name": device, "source": SIMULATED})
    return pl.DataFrame(rows)


# ------------------------------------------------------------------------------------- sweep model



def _norm_us(tokens: int, hidden: int, dtype_bytes: int, hbm_gbps: float) -> float:
    # fused add + RMSNorm reads x and residual, writes residual and the normed output: 4 passes over [T, H]
    return 4 * tokens * hidden * dtype_bytes / (hbm_gbps * 1e3)


def predict_sweep(
    spec: ModelDescription,
    tp: int,
    token_counts: Iterable[int],
    matmul_table: MatmulTable | RooflineMatmul | None = None,
    *,
    comm: AlphaBeta = H200_NVLINK,
    num_layers: int | None = None,
    rule: MatmulRule | None = None,
    dtype_bytes: int = 2,
    hbm_gbps: float = 4300.0,
) -> pl.DataFrame:
    """Predicted per-step latency (attention excluded) of each variant at each token count.

    Args:
        spec: ``ModelSpec``, HF-style dict or preset name (see ``tp_matmul_shapes``).
        tp: tensor-parallel size.
        token_counts: total tokens per step.
        matmul_table: measured single-GPU times (default :meth:`MatmulTable.default`) or a roofline fit.
        comm: the interconnect model.
        num_layers: decoder layers (default: the spec's ``num_layers``/``num_hidden_layers``, else 1).
        rule: a ``MatmulRule``; when given, ``tuned`` rows fuse exactly the matmuls it says "fuse" for.
        hbm_gbps: memory bandwidth for the norms (4.3 TB/s: device-to-device copy seen on an H200 here).

    Returns:
        Rows ``num_tokens, variant, latency_us, matmul_us, comm_us, norm_us, n_fused, fusion_fired,
        fusion_missing, model, tp, num_layers, hidden_size, dtype, comm_model, device_name,
        source="simulated", timing_method="simulated", note`` -- the sweep-store column names.
    """
    table = matmul_table if matmul_table is not None else MatmulTable.default()
    dims = _spec_dims(spec)
    hidden = dims["hidden_size"]
    layers = num_layers or num_layers_of(spec)
    shapes = tp_matmul_shapes(spec, tp)
    tokens = sorted(set(token_counts))
    per_mm = predict_matmul_rows(shapes, tokens, tp, table, hidden_size=hidden, comm=comm, dtype_bytes=dtype_bytes)
    name = spec if isinstance(spec, str) else (getattr(spec, "name", None) or (spec.get("name") if isinstance(
        spec, Mapping) else None) or "custom")
    rows = []
    for t in tokens:
        t_pad = padded_tokens(t, tp)
        mms = per_mm.filter(pl.col("m") == t)
        mm_sum = float(mms["mm_us"].sum())
        act = t_pad * hidden * dtype_bytes
        ar = comm.collective_us("all_reduce", act, tp)
        # sp / sp+async_tp: each matmul row already carries its own reduce_scatter or all_gather (comm_us)
        norm_full = 2 * _norm_us(t_pad, hidden, dtype_bytes, hbm_gbps)
        norm_shard = 2 * _norm_us(t_pad // tp, hidden, dtype_bytes, hbm_gbps)
        decisions = {BASELINE: None, SP: [False] * 4, SP_ASYNC_TP: [True] * 4}
        if rule is not None:
            decisions[TUNED] = [rule.decide(t_pad, r["n"], r["k"], tp) == "fuse" for r in mms.iter_rows(named=True)]
        for variant, fuse in decisions.items():
            if fuse is None:
                matmul_us, comm_us, norm_us, n_fused = mm_sum, 2 * ar, norm_full, 0
            else:
                matmul_us = comm_us = 0.0
                for r, f in zip(mms.iter_rows(named=True), fuse, strict=True):
                    if f:  # overlapped: the kernel costs whichever is longer, charged to the matmul column
                        matmul_us += r["fused_us"]
                    else:
                        matmul_us += r["mm_us"]
                        comm_us += r["comm_us"]
                norm_us, n_fused = norm_shard, sum(fuse)
            latency = layers * (matmul_us + comm_us + norm_us)
            rows.append({"num_tokens": t, "variant": variant, "latency_us": latency, "matmul_us": layers * matmul_us,
                         "comm_us": layers * comm_us, "norm_us": layers * norm_us, "n_fused": n_fused * layers,
                         "fusion_fired": n_fused > 0, "fusion_missing": False})
    df = pl.DataFrame(rows)
    device = table.provenance.get("device", "") if isinstance(table, MatmulTable) else "roofline fit"
    return df.with_columns(
        model=pl.lit(str(name)), tp=pl.lit(tp), num_layers=pl.lit(layers), hidden_size=pl.lit(hidden),
        dtype=pl.lit("bfloat16" if dtype_bytes == 2 else f"{dtype_bytes}-byte"), comm_model=pl.lit(comm.name),
        device_name=pl.lit(f"simulated: {comm.name} + matmuls from {device}"), source=pl.lit(SIMULATED),
        timing_method=pl.lit(SIMULATED),
        note=pl.lit("what-if model: attention excluded; fused kernels assumed to overlap perfectly"),
    )


def compare_to_measured(predicted: pl.DataFrame, measured: pl.DataFrame,
                        on: Sequence[str] = ("num_tokens", "variant", "tp")) -> pl.DataFrame:
    """Prediction error per point where both exist: ``predicted_us, measured_us, error_us, rel_error``.

    ``predicted`` must hold only ``source="simulated"`` rows and ``measured`` only ``"measured"`` ones;
    measured rows whose fusion was expected but missing are dropped (they time another program).
    """
    for df, want, label in ((predicted, SIMULATED, "predicted"), (measured, MEASURED, "measured")):
        got = set(df["source"].unique()) if "source" in df.columns else {None}
        if got != {want}:
            raise ValueError(f"{label} rows must all have source={want!r}; got {sorted(map(str, got))}")
    keys = [c for c in on if c in predicted.columns and c in measured.columns]
    if "fusion_missing" in measured.columns:
        measured = measured.filter(~pl.col("fusion_missing"))
    m = measured.group_by(keys).agg(measured_us=pl.col("latency_us").median())
    p = predicted.select(*keys, predicted_us=pl.col("latency_us"))
    return (
        p.join(m, on=keys, how="inner")
        .with_columns(error_us=pl.col("predicted_us") - pl.col("measured_us"))
        .with_columns(rel_error=pl.col("error_us") / pl.col("measured_us"))
        .sort(keys)
    )
