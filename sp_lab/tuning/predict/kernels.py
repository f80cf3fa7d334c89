"""Single-GPU kernel times the performance model is built from: measured on one H200, scaled to the target GPU.

Three measured ingredients, all shipped under ``data/h200/`` with their provenance:

- ``mm``: one ``[M, K] @ [K, N]`` matmul at the per-rank (shard) shapes, bf16, CUDA-graph replay;
- ``mm_chunked``: the same rows split into ``tp`` matmuls -- what a ``tp``-way fused kernel computes;
- ``fused_ws1``: PyTorch's symmetric-memory fused op on a one-rank group (no peer, no communication): the
  fused kernel's *own* cost over a plain matmul (staging into the symmetric buffer, signals, the final
  reduction on the reduce-scatter side). ``symm_mem_ws1.json`` adds the same ops called eagerly: their host cost.

Shapes the tables lack are estimated by :class:`RooflineMatmul` fitted to the measured rows (labelled so).
:class:`KernelModel` turns H200 times into another GPU's: the memory-bound share of a kernel scales with the
HBM bandwidth ratio, the compute-bound share with the matmul peak ratio (both from datasheets).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from sp_lab.resources import DATA_DIR, H200_DIR, h200_file
from sp_lab.tuning.predict.hardware import Gpu, gpu
from sp_lab.vocabulary import MEASURED

CHUNKING_TP8_JSON = h200_file("gemm_chunking_tp8.json")
"""Plain vs 8-chunk matmuls, Llama-3-70B tp 8 shard shapes (docs/measured-h200.md)."""
SINGLE_GPU_JSON = h200_file("matmul_single_gpu.json")
"""``mm``, ``mm_chunked`` and ``fused_ws1`` rows, written by benchmarks/bench_matmul_h200.py on the H200."""
SYMM_MEM_WS1_JSON = h200_file("symm_mem_ws1.json")
"""The fused ops on a one-rank group, eager and under CUDA graphs (host cost of an eager fused call)."""
FP8_SINGLE_GPU_JSON = h200_file("matmul_fp8_single_gpu.json")
"""FP8 ``torch._scaled_mm`` rows (rowwise, tensorwise, rowwise chunked) beside same-run bf16 ones, written by
benchmarks/bench_matmul_fp8_h200.py on the H200 (read when shipped)."""
RS_REDUCTION_JSON = DATA_DIR / "h100" / "rs_reduction.json"
"""The reduce_scatter side's final ``torch.sum`` over ``[tp, M / tp, N]`` partials (tp = 1: what the one-rank op
runs; tp > 1: what a tp-rank op runs) beside the one-rank fused op and its plain matmul, all timed in one run on one
H100 by benchmarks/bench_rs_reduction.py."""
ATTENTION_JSON = h200_file("attention.json")
"""``sp_lab::attention`` (causal, one sequence), Llama-3-8B heads: 32 query heads of 128, CUDA-graph replay."""
MEASURED_ON = "h200"
"""The GPU the shipped tables were measured on (key in hardware.json)."""

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float8": 1, "float8_tensorwise": 1, "float32": 4}
"""Bytes per element of the dtypes a prediction can be asked for. ``float8`` is FP8 with rowwise scales (per
token and per output channel: vLLM's FP8 on Hopper); ``float8_tensorwise`` has one scale per tensor
(torchtitan's float8 training recipe). Both are ``torch._scaled_mm`` on float8_e4m3fn operands, bf16 out."""
_FP8_TENSORWISE = ("float8_tensorwise", "fp8_tensorwise", "fp8-tensorwise", "float8-tensorwise")
_FP8_ROWWISE = ("float8", "fp8", "fp8_rowwise", "fp8-rowwise", "float8_rowwise", "float8_e4m3fn")


def canonical_dtype(dtype: str) -> str:
    """``"bfloat16"``, ``"float8"`` (rowwise: ``fp8``, ``float8_e4m3fn``, ...), ``"float8_tensorwise"``
    (``fp8-tensorwise``), ...; ``ValueError`` naming the supported spellings."""
    key = str(dtype).removeprefix("torch.").lower()
    if key in _FP8_TENSORWISE:
        return "float8_tensorwise"
    if key in _FP8_ROWWISE:
        return "float8"
    if key not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {sorted(DTYPE_BYTES)} (FP8 also as fp8, "
                         "float8_e4m3fn, fp8-tensorwise)")
    return key


def peak_key(dtype: str) -> str:
    """The datasheet peak a dtype runs at (``Gpu.peak_tflops`` key): both FP8 scalings run at the FP8 peak."""
    key = canonical_dtype(dtype)
    return "float8" if key.startswith("float8") else "bfloat16"


def dtype_bytes(dtype: str | None) -> int:
    """Bytes of one matmul operand element for a dtype label (a prediction's, a row's, a sweep setup's): 1 for
    every FP8 spelling :func:`canonical_dtype` knows (``float8``, ``fp8-rowwise``, ``float8_e4m3fn``,
    ``float8_tensorwise``), 2 for bf16 / fp16, 4 for fp32; ``None`` (rows without a dtype) is bf16, the
    microbenchmarks' default. sp_lab's one answer: training, rules and predictions all ask here."""
    return 2 if dtype is None else DTYPE_BYTES[canonical_dtype(dtype)]


def _interp_loglog(x: float, xs: np.ndarray, ys: np.ndarray) -> float:
    """Piecewise-linear interpolation in (log2 x, log2 y); flat below the smallest x (latency-bound),
    proportional to x above the largest (compute-bound)."""
    order = np.argsort(xs, kind="stable")
    xs, ys = xs[order], ys[order]
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1] * x / xs[-1])
    return float(2 ** np.interp(math.log2(x), np.log2(xs), np.log2(ys)))


@dataclass
class MatmulTable:
    """Measured single-GPU matmul times, looked up by shape and interpolated in M.

    ``rows``: a DataFrame with columns ``m, n, k, variant ("mm" | "mm_chunked" | "fused_ws1"), chunks, us``
    plus ``dtype`` and provenance (``device_name``, ``torch_version``, ``source``). ``chunks`` is 1 for
    ``mm`` and ``fused_ws1``. Every lookup is for one dtype (default bf16): FP8 rows are a separate table.
    """

    rows: pl.DataFrame
    """The measured points (error rows already dropped)."""
    provenance: dict[str, Any] = field(default_factory=dict)
    """Device, torch, date and the files the rows came from."""

    REQUIRED = ("m", "n", "k", "variant", "chunks", "us")

    def __post_init__(self) -> None:
        missing = [c for c in self.REQUIRED if c not in self.rows.columns]
        if missing:
            raise ValueError(f"matmul table lacks columns {missing}; has {self.rows.columns}")
        sources = set(self.rows["source"].unique()) if "source" in self.rows.columns else {MEASURED}
        if sources - {MEASURED}:
            raise ValueError(f"a MatmulTable holds measured times only; got source values {sorted(sources)}")
        self.rows = self.rows.filter(pl.col("us").is_not_null() & (pl.col("us") > 0))
        if "dtype" not in self.rows.columns:
            self.rows = self.rows.with_columns(dtype=pl.lit("bfloat16"))

    def dtypes(self) -> list[str]:
        """The dtypes the table holds rows for."""
        return sorted(self.rows["dtype"].unique().to_list())

    def shapes(self, dtype: str = "bfloat16") -> list[tuple[int, int]]:
        """``(n, k)`` pairs with ``mm`` rows of ``dtype``."""
        mm = self.rows.filter((pl.col("variant") == "mm") & (pl.col("dtype") == dtype))
        return list(mm.select("n", "k").unique().sort("n", "k").iter_rows())

    def has(self, n: int, k: int, variant: str = "mm", dtype: str = "bfloat16") -> bool:
        """Whether rows of this shape, variant and dtype were measured."""
        return self._points(variant, n, k, dtype).height > 0

    def _points(self, variant: str, n: int, k: int, dtype: str, chunks: int | None = None) -> pl.DataFrame:
        # A model evaluation looks up thousands of points: index the rows once per (variant, shape, dtype, chunks).
        key = (variant, n, k, dtype, chunks)
        cache = self.__dict__.setdefault("_index", {})
        if key not in cache:
            cond = (pl.col("variant") == variant) & (pl.col("n") == n) & (pl.col("k") == k) & (pl.col("dtype") == dtype)
            if chunks is not None:
                cond &= pl.col("chunks") == chunks
            cache[key] = self.rows.filter(cond)
        return cache[key]

    def mm_us(self, m: int, n: int, k: int, dtype: str = "bfloat16") -> float:
        """Time of one ``[m, k] @ [k, n]`` matmul, interpolated in log-log between measured M."""
        pts = self._points("mm", n, k, dtype)
        if pts.height == 0:
            raise KeyError(
                f"no measured mm rows for N={n}, K={k} ({dtype}); measured (N, K): {self.shapes(dtype)}; dtypes: "
                f"{self.dtypes()}. Run benchmarks/bench_matmul_h200.py for this model/tp, or use fit_roofline(table)"
            )
        return _interp_loglog(m, pts["m"].to_numpy().astype(float), pts["us"].to_numpy())

    def fused_ws1_us(self, m: int, n: int, k: int, dtype: str = "bfloat16") -> float | None:
        """The fused op on a one-rank group at this shape (``None`` where not measured)."""
        pts = self._points("fused_ws1", n, k, dtype)
        if pts.height == 0:
            return None
        return _interp_loglog(m, pts["m"].to_numpy().astype(float), pts["us"].to_numpy())

    def chunked_us(self, m: int, n: int, k: int, chunks: int, dtype: str = "bfloat16") -> tuple[float, str]:
        """Time of ``m`` rows split into ``chunks`` matmuls, and how it was obtained.

        Uses measured ``mm_chunked`` rows of this shape and chunk count where present, otherwise
        ``chunks * mm_us(m / chunks)`` (the kernels inside a fused op are exactly those matmuls).
        """
        if chunks == 1:
            return self.mm_us(m, n, k, dtype), "mm"
        pts = self._points("mm_chunked", n, k, dtype, chunks)
        if pts.height:
            return _interp_loglog(m, pts["m"].to_numpy().astype(float), pts["us"].to_numpy()), "measured_chunked"
        return chunks * self.mm_us(max(1, m // chunks), n, k, dtype), "chunks_x_mm"

    @classmethod
    def from_files(cls, *paths: str | Path) -> MatmulTable:
        """Load and concatenate shipped tables (``gemm_chunking_tp8.json`` or bench output JSON/parquet)."""
        frames, prov = [], {"files": []}
        for path in paths:
            df, meta = _load_table_file(Path(path))
            frames.append(df)
            prov["files"].append({"path": str(path), **{k: meta.get(k) for k in ("device", "torch", "date", "dtype")}})
        if not frames:
            raise ValueError("MatmulTable.from_files needs at least one file")
        rows = pl.concat(frames, how="diagonal_relaxed")
        prov["device"] = ", ".join(sorted(set(rows["device_name"].unique())))
        # A point measured in several files (the chunking table repeats the bench's tp 8 shapes) is their
        # median: one value per point, whatever order the files were read in.
        key = ["m", "n", "k", "variant", "chunks", "dtype"]
        rows = (rows.group_by(key).agg(pl.col("us").median(), pl.exclude(*key, "us").first()).sort(key))
        return cls(rows, prov)

    @classmethod
    def default(cls) -> MatmulTable:
        """The tables shipped under ``data/h200/``: the single-GPU bench output when present, the tp=8
        chunking table and, once shipped, the FP8 bench output (all measured on one H200)."""
        paths = [p for p in (SINGLE_GPU_JSON, CHUNKING_TP8_JSON, FP8_SINGLE_GPU_JSON) if p.exists()]
        if not paths:
            raise FileNotFoundError(f"no shipped matmul tables under {H200_DIR}; expected {CHUNKING_TP8_JSON.name}")
        return cls.from_files(*paths)


def _load_table_file(path: Path) -> tuple[pl.DataFrame, dict]:
    """Rows ``m, n, k, variant, chunks, us, device_name, torch_version, source`` from one shipped file."""
    if path.suffix == ".parquet":
        raw = pl.read_parquet(path)
        meta = {"device": raw["device"][0], "torch": raw["torch"][0], "date": raw["date"][0], "dtype": raw["dtype"][0]}
        records = raw.to_dicts()
    else:
        data = json.loads(path.read_text())
        meta, records = data["meta"], data["rows"]
    device, torch_version = str(meta.get("device")), str(meta.get("torch"))
    dtype = canonical_dtype(meta.get("dtype") or "bfloat16")
    if meta.get("source", MEASURED) != MEASURED:
        raise ValueError(f"{path}: meta.source is {meta.get('source')!r}; a MatmulTable holds measured rows only")
    out = []
    for r in records:
        if "full_us" in r:  # gemm_chunking_tp8.json layout: one row per (shape, M) with both timings
            base = {"m": r["M"], "n": r["N"], "k": r["K"], "dtype": dtype}
            out.append({**base, "variant": "mm", "chunks": 1, "us": r["full_us"]})
            out.append({**base, "variant": "mm_chunked", "chunks": r["tp"], "us": r["chunked_us"]})
        elif r.get("us") is None:  # a failed or skipped measurement
            continue
        elif r.get("variant") in ("mm", "mm_chunked", "fused_ws1"):  # bench_matmul_h200 layout
            # Bench rows multiply m_padded rows; that is the M the time belongs to.
            out.append({"m": r.get("m_padded", r["m"]), "n": r["n"], "k": r["k"], "variant": r["variant"],
                        "chunks": r.get("chunks", 1), "us": r["us"], "dtype": dtype})
        elif r.get("variant") in FP8_BENCH_VARIANTS:  # bench_matmul_fp8_h200 layout
            variant, row_dtype = FP8_BENCH_VARIANTS[r["variant"]]
            out.append({"m": r.get("m_padded", r["m"]), "n": r["n"], "k": r["k"], "variant": variant,
                        "chunks": r.get("chunks", 1), "us": r["us"], "dtype": row_dtype})
    df = pl.DataFrame(out, schema={"m": pl.Int64, "n": pl.Int64, "k": pl.Int64, "variant": pl.Utf8,
                                   "chunks": pl.Int64, "us": pl.Float64, "dtype": pl.Utf8})
    # Duplicate (shape, M) points from several files or models: their median is kept.
    key = ["m", "n", "k", "variant", "chunks", "dtype"]
    df = df.group_by(key).agg(pl.col("us").median()).sort(key)
    return df.with_columns(device_name=pl.lit(device), torch_version=pl.lit(torch_version),
                           source=pl.lit(MEASURED), file=pl.lit(path.name)), meta


FP8_BENCH_VARIANTS = {"fp8_rowwise": ("mm", "float8"), "fp8_tensorwise": ("mm", "float8_tensorwise"),
                      "fp8_rowwise_chunked": ("mm_chunked", "float8")}
"""benchmarks/bench_matmul_fp8_h200.py's FP8 variants as (table variant, dtype). Its ``bf16`` and ``bf16_chunked``
rows are that run's own reference and are not read: the bf16 predictions keep the bf16 tables they were made from."""


@dataclass(frozen=True)
class RooflineMatmul:
    """``us = floor_us + max(2mnk / peak, bytes / hbm)``: a cost model fitted to a measured table.

    Used to label synthetic fixtures and to estimate shapes the table lacks; never a measurement.
    """

    floor_us: float
    """Time of a tiny matmul (launch and tail effects), microseconds."""
    peak_tflops: float
    """Sustained bf16 matmul rate, TFLOP/s."""
    hbm_gbps: float
    """Effective memory bandwidth for the operands, GB/s."""

    out_bytes: int = 2
    """Element size of the output (bf16 also for FP8 operands)."""

    def mm_us(self, m: int, n: int, k: int, dtype_bytes: int = 2) -> float:
        """Predicted time of one ``[m, k] @ [k, n]`` matmul with ``dtype_bytes``-wide operands."""
        compute, memory = self.parts_us(m, n, k, dtype_bytes)
        return self.floor_us + max(compute, memory)

    def parts_us(self, m: int, n: int, k: int, dtype_bytes: int = 2) -> tuple[float, float]:
        """(compute-bound time, memory-bound time) of one matmul, without the floor."""
        compute = 2.0 * m * n * k / (self.peak_tflops * 1e6)
        memory = (dtype_bytes * (m * k + k * n) + self.out_bytes * m * n) / (self.hbm_gbps * 1e3)
        return compute, memory

    def memory_share(self, m: int, n: int, k: int, dtype_bytes: int = 2) -> float:
        """How memory-bound the matmul is: 1 when its operands' traffic sets its time, toward 0 when compute does."""
        compute, memory = self.parts_us(m, n, k, dtype_bytes)
        return min(1.0, memory / max(compute, memory))


def fit_roofline(table: MatmulTable, dtype: str = "bfloat16") -> RooflineMatmul:
    """Fit :class:`RooflineMatmul` to the table's ``mm`` rows of ``dtype`` (least squares on log time over a grid:
    peaks scaled by the H200 datasheet's peak for that dtype, operands ``dtype``-wide, bf16 output)."""
    key = canonical_dtype(dtype)
    mm = table.rows.filter((pl.col("variant") == "mm") & (pl.col("dtype") == key))
    if mm.height < 3:
        raise ValueError(f"too few measured {key} mm rows to fit a roofline ({mm.height}); dtypes: {table.dtypes()}")
    m, n, k, us = (mm[c].to_numpy().astype(float) for c in ("m", "n", "k", "us"))
    width = dtype_bytes(key)
    h200 = gpu(MEASURED_ON).peak_tflops
    peaks = np.linspace(500, 990, 50) * h200[peak_key(key)] / h200["bfloat16"]  # FP8: twice the bf16 grid
    best, best_err = None, math.inf
    for floor in np.linspace(0.5 * us.min(), us.min(), 6):
        for peak in peaks:
            for hbm in np.linspace(2000, 4800, 29):
                pred = floor + np.maximum(2 * m * n * k / (peak * 1e6),
                                          (width * (m * k + k * n) + 2 * m * n) / (hbm * 1e3))
                err = float(np.mean(np.log(pred / us) ** 2))
                if err < best_err:
                    best, best_err = (floor, peak, hbm), err
    floor, peak, hbm = best
    return RooflineMatmul(floor_us=float(floor), peak_tflops=float(peak), hbm_gbps=float(hbm))




# ------------------------------------------------------------------------------------------ the fused op


@dataclass(frozen=True)
class StagingFit:
    """The fused op's own cost where no ``fused_ws1`` row exists: ``fixed_us + bytes / gbps``.

    Least squares over the measured ``fused_ws1 - mm`` differences of one side; bytes are the staged
    input ``[M, K]`` on the all_gather side and the staged output ``[M, N]`` on the reduce_scatter side.
    """

    fixed_us: float
    """Cost independent of size (barriers, signals), us."""
    gbps: float
    """Bytes staged per second, GB/s."""

    def us(self, nbytes: float) -> float:
        """Overhead for ``nbytes`` staged bytes."""
        return self.fixed_us + nbytes / (self.gbps * 1e3)


def fit_staging(table: MatmulTable, side: str) -> StagingFit:
    """Fit :class:`StagingFit` to the ``fused_ws1`` rows of ``side`` (``"ag"``: K-wide inputs staged, ``"rs"``:
    N-wide outputs). Which side a shape is on comes from its N/K layout in the shipped bench rows."""
    rows = table.rows.filter(pl.col("dtype") == "bfloat16")
    mm = rows.filter(pl.col("variant") == "mm").select("m", "n", "k", mm_us="us")
    ws1 = rows.filter(pl.col("variant") == "fused_ws1").select("m", "n", "k", ws1_us="us")
    both = ws1.join(mm, on=["m", "n", "k"]).join(_side_of_shape(), on=["n", "k"]).filter(pl.col("side") == side)
    if both.height < 2:
        raise ValueError(f"no fused_ws1 rows for side {side!r}: run benchmarks/bench_matmul_h200.py on a GPU")
    width = both["k"] if side == "ag" else both["n"]
    nbytes = (both["m"] * width * 2).to_numpy().astype(float)
    extra = (both["ws1_us"] - both["mm_us"]).to_numpy()
    slope, fixed = np.polyfit(nbytes, extra, 1)
    return StagingFit(fixed_us=max(0.0, float(fixed)), gbps=float(1.0 / (max(slope, 1e-12) * 1e3)))


@cache
def _side_of_shape() -> pl.DataFrame:
    """``n, k, side`` of every shape the bench measured (its rows say which side each matmul is on)."""
    data = json.loads(SINGLE_GPU_JSON.read_text()) if SINGLE_GPU_JSON.exists() else {"rows": []}
    pairs = {(r["n"], r["k"], r["side"]) for r in data["rows"] if "side" in r}
    return pl.DataFrame(sorted(pairs), schema={"n": pl.Int64, "k": pl.Int64, "side": pl.Utf8}, orient="row")


FUSED_STEP_CALLS = {"ag": 2, "rs": 4}
"""Host-side op calls a ``tp``-way fused op issues per remote chunk, beyond what its one-rank call issues, read off
PyTorch's ``torch/distributed/_symmetric_memory/__init__.py`` (2.11-2.14): the all_gather side
(``_pipelined_multi_all_gather_and_consume``) copies the peer's shard (``copy_``) and multiplies it (``mm.out``);
the reduce_scatter side (``_pipelined_produce_and_all2all``) multiplies a chunk, waits at a barrier, copies the
peer's partial and waits at a second barrier. A one-rank group runs neither loop (``range(1, 1)``), so the
one-rank measurement holds none of these calls."""
FUSED_RS_EXTRA_CALLS = 1
"""The reduce_scatter side's one ``torch.cuda._sleep`` launch (it orders the two streams' first chunks), issued
at any ``tp > 1`` and not on a one-rank group."""


@cache
def launch_host_us() -> float:
    """Host time of one eager op call, from ``symm_mem_ws1.json``: the plain matmul at the smallest M measured,
    where the device finishes first (its CUDA-graph time is below the eager one), so the eager loop's time per
    call is the host's: Python, dispatch and launch."""
    rows = json.loads(SYMM_MEM_WS1_JSON.read_text())["rows"]
    row = min(rows, key=lambda r: r["M"])
    if row["mm_ag_graph"] >= row["mm_ag_eager"]:
        raise ValueError(f"{SYMM_MEM_WS1_JSON.name}: the smallest-M plain matmul is device-bound "
                         f"(graph {row['mm_ag_graph']} us >= eager {row['mm_ag_eager']} us); no host-bound row")
    return float(row["mm_ag_eager"])


def fused_host_us(side: str, tp: int) -> float:
    """Host time of one eager ``tp``-way fused call: the one-rank op's (``host_cost_us()[side]``, measured) plus
    one :func:`launch_host_us` per op call the ``tp - 1`` remote chunks add (:data:`FUSED_STEP_CALLS`, and the
    reduce_scatter side's sleep). A lower bound: the per-step Python (buffer views, stream switches) is not
    counted."""
    if side not in FUSED_STEP_CALLS:
        raise ValueError(f"side must be one of {sorted(FUSED_STEP_CALLS)}, got {side!r}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    calls = (tp - 1) * FUSED_STEP_CALLS[side] + (FUSED_RS_EXTRA_CALLS if side == "rs" and tp > 1 else 0)
    return host_cost_us()[side] + calls * launch_host_us()


@cache
def host_cost_us() -> dict[str, float]:
    """Host time of one eager call, from ``symm_mem_ws1.json``: ``"mm"`` (a plain matmul) and the fused ops
    ``"ag"`` / ``"rs"`` (median over M: they are launch-bound there, flat in M)."""
    rows = json.loads(SYMM_MEM_WS1_JSON.read_text())["rows"]
    columns = {"mm": "mm_ag_eager", "ag": "fused_ag_mm_eager", "rs": "fused_mm_rs_eager"}
    return {key: float(np.median([r[col] for r in rows])) for key, col in columns.items()}


# ------------------------------------------------------------------------------------------ per GPU


@dataclass
class KernelModel:
    """Kernel times on ``target`` for one dtype: measured H200 rows where the shape was measured, a roofline
    fit to them elsewhere, each scaled from the H200 to ``target`` by its memory / compute share."""

    table: MatmulTable
    """The measured H200 rows."""
    target: Gpu
    """The GPU predicted for."""
    dtype: str = "bfloat16"
    """Matmul dtype (``"bfloat16"``; ``"float8"`` once FP8 tables are shipped)."""
    measured_shapes: bool = True
    """Read measured rows where the shape was measured. ``False``: every shape from the forms fitted to them
    (roofline, staging fit), a smooth function of the shape -- for synthetic fixtures a rule must learn."""
    roofline: RooflineMatmul = field(init=False)
    """Fit to the table's ``mm`` rows of this dtype: estimates for unmeasured shapes, each kernel's memory share."""
    staging: dict[str, StagingFit] = field(init=False)
    """Fused-op overhead fits per side, for shapes without ``fused_ws1`` rows."""
    memory_gbps: float = field(init=False)
    """H200 memory rate of bf16 passes (norms, activations): the bf16 roofline fit's, whatever the matmul dtype."""
    estimated: set[tuple[int, int]] = field(init=False, default_factory=set)
    """(N, K) shapes that came from the roofline fit, not a measurement (shown in every prediction)."""

    def __post_init__(self) -> None:
        key = canonical_dtype(self.dtype)
        if key not in self.table.dtypes():
            raise ValueError(
                f"no measured {key} matmul table (have {self.table.dtypes()}): the model predicts from measured "
                f"single-GPU tables only; FP8 predictions need {FP8_SINGLE_GPU_JSON.name} under data/h200/ "
                "(benchmarks/bench_matmul_fp8_h200.py on an H200)"
            )
        self.dtype = key
        # fitted once per table and dtype (a grid search over its rows), kept on the table
        fits = self.table.__dict__.setdefault("_fits", {})
        if ("roofline", key) not in fits:
            fits["roofline", key] = fit_roofline(self.table, key)
        if "staging" not in fits:  # the one-rank fused-op rows are bf16 (no FP8 one-rank measurement)
            fits["staging"] = {side: fit_staging(self.table, side) for side in ("ag", "rs")}
        if ("roofline", "bfloat16") not in fits:
            fits["roofline", "bfloat16"] = fit_roofline(self.table)
        self.roofline, self.staging = fits["roofline", key], fits["staging"]
        self.memory_gbps = fits["roofline", "bfloat16"].hbm_gbps  # norms and other bf16 passes
        self.measured_on = gpu(MEASURED_ON)

    @property
    def bytes(self) -> int:
        """Element size of the activations moved (bf16: 2; FP8 activations also travel as 1 byte)."""
        return dtype_bytes(self.dtype)

    def _scale(self, us: float, memory_share: float) -> float:
        """H200 time -> target time: each share scales with its own peak ratio."""
        hbm = self.measured_on.hbm_gbps / self.target.hbm_gbps
        flops = self.measured_on.peak_tflops[peak_key(self.dtype)] / self.target.peak_tflops[peak_key(self.dtype)]
        return us * (memory_share * hbm + (1.0 - memory_share) * flops)

    def _measured(self, n: int, k: int) -> bool:
        return self.measured_shapes and self.table.has(n, k, "mm", self.dtype)

    def _share(self, m: int, n: int, k: int) -> float:
        return self.roofline.memory_share(m, n, k, self.bytes)

    def mm_us(self, m: int, n: int, k: int) -> float:
        """One ``[m, k] @ [k, n]`` matmul on the target."""
        if self._measured(n, k):
            us = self.table.mm_us(m, n, k, self.dtype)
        else:
            self.estimated.add((n, k))
            us = self.roofline.mm_us(m, n, k, self.bytes)
        return self._scale(us, self._share(m, n, k))

    def chunk_us(self, m: int, n: int, k: int, chunks: int) -> float:
        """One of ``chunks`` equal row chunks of an ``m``-row matmul (measured chunked rows where present)."""
        if self._measured(n, k):
            total, _ = self.table.chunked_us(m, n, k, chunks, self.dtype)
            us = total / chunks
        else:
            self.estimated.add((n, k))
            us = self.roofline.mm_us(max(1, m // chunks), n, k, self.bytes)
        return self._scale(us, self._share(max(1, m // chunks), n, k))

    def fused_overhead_us(self, side: str, m: int, n: int, k: int, tp: int) -> float:
        """The fused op's own cost beyond its matmuls and copies, on the target.

        All_gather side: staging the local ``[m/tp, K]`` shard, read off the one-rank measurement at
        ``m/tp`` rows. Reduce_scatter side: reducing ``[m, N]`` partial outputs, the one-rank measurement at ``m``
        rows with its ``[1, m, N]`` sum swapped for the ``[tp, m/tp, N]`` sum a ``tp``-rank op runs
        (:func:`rs_own_cost_ratio`).
        """
        rows = max(1, m // tp) if side == "ag" else m
        ws1 = self.table.fused_ws1_us(rows, n, k, self.dtype) if self.measured_shapes else None
        if ws1 is not None:
            extra = max(0.0, ws1 - self.table.mm_us(rows, n, k, self.dtype))
        else:  # staged bytes: FP8 inputs on the all_gather side, bf16 partial outputs on the reduce_scatter side
            extra = self.staging[side].us(rows * (k * self.bytes if side == "ag" else n * 2))
        if side == "rs" and tp > 1:
            extra *= rs_own_cost_ratio(rows * n * 2, tp)
        return self._scale(extra, 1.0)

    def elementwise_us(self, nbytes: float) -> float:
        """A memory-bound pass over ``nbytes`` (norms, residual adds) at the H200 memory rate the roofline fit to
        the measured matmuls found, scaled to the target."""
        return self._scale(nbytes / (self.memory_gbps * 1e3), 1.0)

    def attention_us(self, tokens: int, q_heads: int, head_dim: int) -> float:
        """Causal attention of one ``tokens``-long sequence with ``q_heads`` query heads on this rank.

        From the H200 ``sp_lab::attention`` rows (32 heads of 128), in proportion to ``q_heads * head_dim``,
        never below the table's smallest time (launch-bound); scaled as compute-bound to the target.
        """
        xs, ys = _attention_points()
        us = _interp_loglog(float(tokens), xs, ys) * q_heads * head_dim / (32 * 128)
        return self._scale(max(us, float(ys.min())), 0.0)

    def contention(self, m: int, n: int, k: int, copy_gbps: float) -> float:
        """How much slower a chunk matmul runs while copies stream at ``copy_gbps`` through this GPU.

        Each GPU both sends and receives: copies take ``2 * copy_gbps`` of HBM bandwidth. A matmul slows by
        that share of the target's HBM, in proportion to how memory-bound it is (compute-bound: ~1).
        """
        share_taken = min(0.9, 2.0 * copy_gbps / self.target.hbm_gbps)
        memory = self._share(m, n, k)
        return 1.0 + memory * share_taken / (1.0 - share_taken)


@cache
def _own_cost_ratios() -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``tp -> (bytes of [M, N] partials, own cost at tp / own cost on one rank)`` from :data:`RS_REDUCTION_JSON`
    (empty where it is not shipped): per M, the one-rank op's own cost (fused minus plain matmul) with its
    ``[1, M, N]`` sum swapped for the measured ``[tp, M / tp, N]`` one, over the one-rank own cost."""
    if not RS_REDUCTION_JSON.exists():
        return {}
    data = json.loads(RS_REDUCTION_JSON.read_text())
    sums = {(r["m"], r["n"], r["tp"]): float(r["us"]) for r in data["rows"]}
    ratios: dict[int, list[tuple[float, float]]] = {}
    for r in data["one_rank_fused"]:
        m, n = r["m"], r["n"]
        own = r["fused_ws1_us"] - r["mm_us"]
        for tp in sorted({t for (mm, nn, t) in sums if (mm, nn) == (m, n) and t > 1}):
            tp_own = max(0.0, own - sums[m, n, 1] + sums[m, n, tp])
            ratios.setdefault(tp, []).append((2.0 * m * n, tp_own / own))
    return {tp: (np.array([b for b, _ in sorted(p)]), np.array([x for _, x in sorted(p)]))
            for tp, p in ratios.items()}


def rs_own_cost_ratio(nbytes: float, tp: int) -> float:
    """How much of the one-rank reduce_scatter-side own cost a ``tp``-rank op pays for ``nbytes`` of bf16 partials.

    The one-rank op (``data/h200`` ``fused_ws1`` rows) sums its ``[1, M, N]`` partials -- torch's reduction over a
    dimension of one, reading and writing ``M * N`` far below the HBM rate, almost all of its own cost (measured:
    201.8 us own cost, 201.3 us sum at M = N = 8192 on the H100); a ``tp``-rank op sums ``[tp, M / tp, N]``, reading
    ``M * N`` and writing ``M / tp * N`` near the HBM rate. The ratio is measured on one H100 in one run, linear in
    log bytes between the measured sizes and held at the ends; 1 (the one-rank cost) for a ``tp`` not measured."""
    ratios = _own_cost_ratios()
    if tp not in ratios:
        return 1.0
    xs, ys = ratios[tp]
    return float(np.interp(math.log2(max(nbytes, 1.0)), np.log2(xs), ys))


@cache
def _attention_points() -> tuple[np.ndarray, np.ndarray]:
    rows = json.loads(ATTENTION_JSON.read_text())["rows"]
    return (np.array([float(r["num_tokens"]) for r in rows]), np.array([1000.0 * r["sp_lab_ms"] for r in rows]))


@cache
def default_table() -> MatmulTable:
    """The shipped H200 tables, loaded once."""
    return MatmulTable.default()
