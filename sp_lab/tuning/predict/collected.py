"""Multi-GPU tables collected on real systems, read from NVIDIA's ``aiconfigurator-core`` package.

``aiconfigurator-core`` (Apache-2.0, on PyPI; the optional extra ``sp_lab[tables]``, also part of ``dev``) ships
tables its collector timed on real 8-GPU systems, under ``aiconfigurator_core/systems/data/<system>/``:

- ``comm/nccl/<nccl version>/nccl_perf.parquet``: nccl-tests' ``all_gather``, ``reduce_scatter``,
  ``all_reduce``, ``alltoall`` (``half`` and ``int8``; 2, 4, 8 GPUs);
- ``comm/vllm/<vLLM version>/custom_allreduce_perf.parquet``: vLLM's ``tensor_model_parallel_all_reduce`` under a
  CUDA graph (``vllm_graph``) and eagerly (``vllm_eager``);
- ``gemm/vllm/<vLLM version>/gemm_perf.parquet``: vLLM's own GEMM kernels over an (m, n, k) grid.

The package's query API lives in its compiled engine and answers for whole model ops, not one table row, so
sp_lab reads the parquet files with polars (the files are the package's public data; nothing is copied).

**Units** (from the package's collector, ``collector/collect_nccl.py`` and ``collect_all_reduce.py`` in
github.com/ai-dynamo/aiconfigurator): ``message_size`` counts *elements*, not bytes -- the NCCL collector runs
nccl-tests with ``-b`` bytes and stores ``size // bytes_per_element`` (2 for ``half``, 1 for ``int8``); the vLLM
collector builds a tensor of ``message_size`` bfloat16 elements. nccl-tests' size is the whole tensor (the
all_gather's output, the reduce_scatter's input). ``latency`` is milliseconds in every table.

Every lookup says where its number came from (:class:`Lookup`): on a grid point, interpolated between two
(log-log, piecewise linear), or outside the grid (flat below the smallest size, proportional above the largest:
flagged, never silent).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import ClassVar, Self

import numpy as np
import polars as pl

PACKAGE = "aiconfigurator-core"
"""The distribution the tables come from."""
PINNED_VERSION = "0.12.0"
"""The version sp_lab was checked against (pyproject's ``tables`` extra pins it)."""
INSTALL_HINT = f'pip install "sp_lab[tables]" (or: pip install {PACKAGE}=={PINNED_VERSION}, a ~80 MB wheel)'
"""How to get the tables."""

NCCL_ELEMENT_BYTES = {"half": 2, "int8": 1}
"""Bytes per ``message_size`` element of each ``nccl_dtype`` (the collector's ``bytes_per_element``)."""
VLLM_ELEMENT_BYTES = 2
"""The vLLM all-reduce table's tensors are bfloat16."""
GEMM_DTYPES = {"bfloat16": ("bfloat16", ("torch.nn.functional.linear", "vllm_default")),
               "float8": ("fp8", ("CutlassFP8ScaledMMLinearKernel",))}
"""sp_lab dtype -> (``gemm_dtype``, ``kernel_source`` values in order of preference) of the GEMM table rows that
time it: bf16 through ``F.linear`` (``vllm_default`` in the older tables, e.g. a100_sxm's vLLM 0.14.0), FP8 with
per-token / per-channel scales through vLLM's CUTLASS scaled-mm kernel."""

ON_GRID, INTERPOLATED, BELOW_GRID, ABOVE_GRID = "on grid", "interpolated", "below grid", "above grid"
"""Where a looked-up number lies relative to the collected grid."""


class TablesUnavailable(ValueError):
    """The package is not installed, or has no table (or no rows) of this kind for this system; says what there is
    and how to get it."""


@dataclass(frozen=True)
class Lookup:
    """One number read from a collected table."""

    us: float
    """Microseconds."""
    grid: str
    """:data:`ON_GRID`, :data:`INTERPOLATED`, :data:`BELOW_GRID` or :data:`ABOVE_GRID`."""
    table: str
    """Which table: ``"<system> nccl 2.29.2"``, ``"<system> vllm 0.24.0 custom_allreduce"``, ..."""

    @property
    def outside(self) -> bool:
        """Whether the number was extrapolated beyond the collected grid."""
        return self.grid in (BELOW_GRID, ABOVE_GRID)


# ------------------------------------------------------------------------------------------ where the files are


def data_root() -> Path | None:
    """``aiconfigurator_core/systems/data`` of the installed package (``None`` when it is not installed).
    Found without importing the package, whose import loads its compiled engine."""
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "systems" / "data"
    return root if root.is_dir() else None


def installed_version() -> str | None:
    """The installed ``aiconfigurator-core`` version, ``None`` when absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return None


def available() -> bool:
    """Whether collected tables can be read here."""
    return data_root() is not None


def _version_key(v: str) -> tuple:
    # "2.29.2" > "2.27.3" > "2.23"; "1.3.0rc20" after "1.3.0rc10"
    return tuple(int(x) for x in re.findall(r"\d+", v))


def _table_dir(system: str, kind: str) -> Path:
    root = data_root()
    if root is None:
        raise TablesUnavailable(f"collected tables need {PACKAGE}: {INSTALL_HINT}")
    sub = {"nccl": "comm/nccl", "vllm_allreduce": "comm/vllm", "gemm": "gemm/vllm", "context_attention":
           "attention/vllm", "generation_attention": "attention/vllm"}[kind]
    return root / system / sub


_FILES = {"nccl": "nccl_perf.parquet", "vllm_allreduce": "custom_allreduce_perf.parquet", "gemm": "gemm_perf.parquet",
          "context_attention": "context_attention_perf.parquet",
          "generation_attention": "generation_attention_perf.parquet"}


def versions(system: str, kind: str) -> list[str]:
    """Versions (NCCL's for ``"nccl"``, vLLM's for ``"vllm_allreduce"`` / ``"gemm"``) with a ``kind`` table for
    ``system``, oldest first."""
    d = _table_dir(system, kind)
    if not d.is_dir():
        return []
    return sorted((p.name for p in d.iterdir() if (p / _FILES[kind]).is_file()), key=_version_key)


def table_path(system: str, kind: str, version: str | None = None) -> tuple[Path, str]:
    """The parquet file of ``kind`` for ``system`` at ``version`` (default: the newest) and that version;
    :class:`TablesUnavailable` naming the versions there are otherwise."""
    have = versions(system, kind)
    if not have:
        raise TablesUnavailable(f"{PACKAGE} {installed_version()} has no {kind} table for system {system!r}; "
                                f"systems with tables: {', '.join(systems_with_tables())}")
    chosen = version or have[-1]
    if chosen not in have:
        raise TablesUnavailable(f"no {kind} table of version {chosen!r} for {system!r}; versions: {', '.join(have)}")
    return _table_dir(system, kind) / chosen / _FILES[kind], chosen


@cache
def systems_with_tables() -> tuple[str, ...]:
    """Systems with all three tables sp_lab reads (NCCL, vLLM all-reduce, vLLM GEMM); empty without the package."""
    root = data_root()
    if root is None:
        return ()
    return tuple(sorted(s.name for s in root.iterdir()
                        if all(versions(s.name, kind) for kind in ("nccl", "vllm_allreduce", "gemm"))))


# ------------------------------------------------------------------------------------------ interpolation


def interp_loglog(x: float, xs: np.ndarray, ys: np.ndarray) -> tuple[float, str]:
    """``y`` at ``x`` from sorted grid points: exact on a point, piecewise linear in (log x, log y) between two,
    the smallest ``y`` below the grid (latency-bound sizes), ``y`` in proportion to ``x`` above it."""
    if x <= xs[0]:
        return float(ys[0]), ON_GRID if x == xs[0] else BELOW_GRID
    if x >= xs[-1]:
        return float(ys[-1] * x / xs[-1]), ON_GRID if x == xs[-1] else ABOVE_GRID
    i = int(np.searchsorted(xs, x))
    if xs[i] == x:
        return float(ys[i]), ON_GRID
    t = (math.log(x) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
    return float(math.exp((1 - t) * math.log(ys[i - 1]) + t * math.log(ys[i]))), INTERPOLATED


# ------------------------------------------------------------------------------------------ collectives


@dataclass(frozen=True)
class _CommTable:
    """A collected communication table of one system and one version, kept as its parquet rows."""

    KIND: ClassVar[str]
    """The table's kind for :func:`table_path`."""

    system: str
    """aiconfigurator system name (``"h200_sxm"``)."""
    version: str
    """The collecting library's version (NCCL's, or vLLM's)."""
    rows: pl.DataFrame
    """The parquet's rows."""
    index: dict = field(default_factory=dict, repr=False, compare=False)
    """Grid points per series, filled on first use (a prediction looks up thousands of times)."""

    @classmethod
    def load(cls, system: str, version: str | None = None) -> Self:
        """The table of ``system`` (the newest version unless named)."""
        path, chosen = table_path(system, cls.KIND, version)
        return cls(system=system, version=chosen, rows=pl.read_parquet(path))


@dataclass(frozen=True)
class CollectiveTable(_CommTable):
    """nccl-tests times of one system and NCCL version: ``op, nccl_dtype, num_gpus, message_size, latency``; the
    index holds grid points per (op, dtype, GPUs)."""

    KIND = "nccl"

    @property
    def label(self) -> str:
        """Names the table in provenance columns."""
        return f"{self.system} NCCL {self.version} (nccl-tests)"

    def latency(self, op: str, nbytes: float, tp: int, element_bytes: int = 2) -> Lookup:
        """Time of ``op`` over ``tp`` GPUs on a whole tensor of ``nbytes`` bytes whose elements are
        ``element_bytes`` wide (2: the ``half`` rows, 1: the ``int8`` rows)."""
        dtype = {2: "half", 1: "int8"}.get(element_bytes)
        if dtype is None:
            raise ValueError(f"element_bytes must be 2 (half) or 1 (int8), got {element_bytes}")
        xs, ys = _points(self.rows, self.index, (pl.col("op_name") == op) & (pl.col("nccl_dtype") == dtype)
                         & (pl.col("num_gpus") == tp), f"{self.label}: {op} {dtype} on {tp} GPUs")
        ms, grid = interp_loglog(nbytes / NCCL_ELEMENT_BYTES[dtype], xs, ys)
        return Lookup(us=1e3 * ms, grid=grid, table=self.label)


def _points(rows: pl.DataFrame, index: dict, cond: pl.Expr, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Sorted ``message_size`` and median ``latency`` of the rows matching ``cond`` (``what`` names them),
    kept in ``index`` under ``what``."""
    if what not in index:
        pts = rows.filter(cond).group_by("message_size").agg(pl.col("latency").median()).sort("message_size")
        if pts.height == 0:
            counts = ", ".join(map(str, sorted(rows["num_gpus"].unique().to_list())))
            raise TablesUnavailable(f"no collected rows for {what} (the table has {counts} GPUs); pick a tp it "
                                    "has, or --modelled-only")
        index[what] = (pts["message_size"].to_numpy().astype(float), pts["latency"].to_numpy().astype(float))
    return index[what]


# ------------------------------------------------------------------------------------------ vLLM's all-reduce

MiB = 1 << 20
CUSTOM_AR_DEFAULT_MAX_BYTES = 8 * MiB
"""``CustomAllreduce(max_size=8192 * 1024)`` in vLLM's ``vllm/distributed/device_communicators/custom_all_reduce.py``:
the custom all-reduce's buffer, and so its largest tensor, where no per-architecture limit applies."""
CUSTOM_AR_MAX_BYTES = {"9.0": {2: 64 * MiB, 4: 32 * MiB, 6: MiB // 2, 8: MiB // 4},
                       "10.0": {2: 2 * MiB, 4: 2 * MiB, 6: 1 * MiB, 8: 1 * MiB},
                       "10.3": {2: 4 * MiB, 4: 4 * MiB, 6: 8 * MiB, 8: 4 * MiB}}
"""vLLM's ``CUSTOM_ALL_REDUCE_MAX_SIZES`` (``vllm/distributed/device_communicators/all_reduce_utils.py``): with
PyTorch symmetric memory enabled (``VLLM_ALLREDUCE_USE_SYMM_MEM``, on by default) the custom all-reduce takes a
tensor only below ``min(this, 8 MiB)`` bytes, per compute capability and world size."""
SYMM_MEM_MAX_BYTES = {"9.0": {2: 64 * MiB, 4: 32 * MiB, 6: 64 * MiB, 8: 64 * MiB},
                      "10.0": {2: 8 * MiB, 4: 32 * MiB, 6: 128 * MiB, 8: 128 * MiB},
                      "10.3": {2: 4 * MiB, 4: 32 * MiB, 6: 128 * MiB, 8: 128 * MiB}}
"""vLLM's ``SYMM_MEM_ALL_REDUCE_MAX_SIZES`` (same file): above the custom all-reduce's limit and below this, vLLM
runs PyTorch's symmetric-memory all-reduce (multimem / two-shot); above it, NCCL (``pynccl``)."""
CUSTOM, SYMM_MEM, NCCL = "custom", "symm_mem", "nccl"
"""The all-reduce implementations vLLM picks between on CUDA."""


def vllm_all_reduce_impl(capability: str, tp: int, nbytes: float, *, nvlink: bool) -> str:
    """Which all-reduce vLLM runs for a bf16 tensor of ``nbytes`` bytes over ``tp`` GPUs of ``capability``
    (``"9.0"``): vLLM's ``CudaCommunicator.all_reduce`` tries the custom all-reduce first (``should_custom_ar``:
    world size 2 or NVLink-connected, below its size limit), then PyTorch symmetric memory (SM 9.0 / 10.x, below
    :data:`SYMM_MEM_MAX_BYTES`), then NCCL. On more than two PCIe-only GPUs vLLM disables the custom all-reduce."""
    if tp == 1:
        return CUSTOM
    limit = min(CUSTOM_AR_MAX_BYTES.get(capability, {}).get(tp, CUSTOM_AR_DEFAULT_MAX_BYTES),
                CUSTOM_AR_DEFAULT_MAX_BYTES)
    if (tp == 2 or nvlink) and tp in (2, 4, 6, 8) and nbytes < limit:
        return CUSTOM
    if nbytes < SYMM_MEM_MAX_BYTES.get(capability, {}).get(tp, 0):
        return SYMM_MEM
    return NCCL


@dataclass(frozen=True)
class VllmAllReduceTable(_CommTable):
    """vLLM's ``tensor_model_parallel_all_reduce`` timed by the collector, CUDA graph and eager, bf16.

    The collector times vLLM's own dispatch, so at each size the row is whichever implementation that vLLM
    picked there on that machine (:func:`vllm_all_reduce_impl`)."""

    KIND = "vllm_allreduce"

    @property
    def label(self) -> str:
        """Names the table in provenance columns."""
        return f"{self.system} vLLM {self.version} all-reduce"

    def latency(self, nbytes: float, tp: int, *, graph: bool = True) -> Lookup:
        """Time of vLLM's all-reduce of ``nbytes`` bf16 bytes over ``tp`` GPUs (CUDA graph or eager)."""
        backend = "vllm_graph" if graph else "vllm_eager"
        xs, ys = _points(self.rows, self.index, (pl.col("backend") == backend) & (pl.col("num_gpus") == tp),
                         f"{self.label}: {backend} on {tp} GPUs")
        ms, grid = interp_loglog(nbytes / VLLM_ELEMENT_BYTES, xs, ys)
        return Lookup(us=1e3 * ms, grid=grid, table=f"{self.label} ({backend})")


# ------------------------------------------------------------------------------------------ GEMM


@dataclass
class GemmTable:
    """vLLM's GEMM kernel times of one system over its (m, n, k) grid, for one dtype.

    A shape between grid points is interpolated in (log m, log n, log k, log time), multilinearly over the
    eight surrounding points; outside the grid in n or k the nearest edge is scaled in proportion to the size
    (flagged), above the largest m likewise (compute-bound)."""

    system: str
    """aiconfigurator system name."""
    version: str
    """vLLM version of the table."""
    dtype: str
    """``"bfloat16"`` or ``"float8"``."""
    kernel: str
    """The ``kernel_source`` whose rows were read."""
    grid: tuple[np.ndarray, np.ndarray, np.ndarray]
    """Sorted m, n, k values."""
    ms: np.ndarray
    """Latency in ms, shape ``(len(m), len(n), len(k))``; NaN where the grid lacks a point."""

    @classmethod
    def load(cls, system: str, dtype: str = "bfloat16", version: str | None = None) -> GemmTable:
        """The GEMM table of ``system`` for ``dtype`` (newest vLLM version unless named)."""
        if dtype not in GEMM_DTYPES:
            raise TablesUnavailable(f"no collected GEMM rows for dtype {dtype!r}; have {sorted(GEMM_DTYPES)}")
        path, chosen = table_path(system, "gemm", version)
        gemm_dtype, kernels = GEMM_DTYPES[dtype]
        have = pl.read_parquet(path, columns=["gemm_dtype", "kernel_source"]).filter(
            pl.col("gemm_dtype") == gemm_dtype)["kernel_source"].unique().to_list()
        kernel = next((k for k in kernels if k in have), None)
        if kernel is None:
            raise TablesUnavailable(f"{system} vLLM {chosen} GEMM table has no {gemm_dtype} rows from "
                                    f"{' or '.join(kernels)} (has {sorted(have)})")
        rows = pl.scan_parquet(path).filter(
            (pl.col("gemm_dtype") == gemm_dtype) & (pl.col("kernel_source") == kernel)).collect()
        axes, cube = _cube(rows, ("m", "n", "k"))
        return cls(system=system, version=chosen, dtype=dtype, kernel=kernel, grid=axes, ms=cube)  # type: ignore[arg-type]

    @property
    def label(self) -> str:
        """Names the table in provenance columns."""
        return f"{self.system} vLLM {self.version} GEMM ({self.kernel})"

    def latency(self, m: int, n: int, k: int) -> Lookup:
        """Time of one ``[m, k] @ [k, n]`` matmul (flat below the smallest m: launch-bound)."""
        ms, grid = interp_grid(self.grid, self.ms, (m, n, k), flat_below=(True, False, False),
                               what=f"{self.label}: m={m}, n={n}, k={k}")
        return Lookup(us=1e3 * ms, grid=grid, table=self.label)


def interp_grid(axes: tuple[np.ndarray, ...], values: np.ndarray, point: tuple[float, ...], *,
                flat_below: tuple[bool, ...], what: str) -> tuple[float, str]:
    """A value of a grid at ``point``: multilinear in (log coordinate, log value) over the surrounding grid points
    that exist (NaN = not collected). Beyond an axis' largest value the edge is scaled in proportion to the
    coordinate; below its smallest likewise, or held flat where ``flat_below`` says so."""
    scale, grid = 1.0, ON_GRID
    corners: list[list[tuple[int, float]]] = []  # per axis: (index, weight) pairs
    for axis, x, flat in zip(axes, point, flat_below, strict=True):
        if x > axis[-1]:
            scale *= x / axis[-1]
            corners.append([(len(axis) - 1, 1.0)])
            grid = ABOVE_GRID
        elif x < axis[0]:
            scale *= 1.0 if flat else x / axis[0]
            corners.append([(0, 1.0)])
            grid = BELOW_GRID
        else:
            i = int(np.searchsorted(axis, x))
            if axis[i] == x:
                corners.append([(i, 1.0)])
            else:
                t = (math.log(x) - math.log(axis[i - 1])) / (math.log(axis[i]) - math.log(axis[i - 1]))
                corners.append([(i - 1, 1 - t), (i, t)])
                grid = INTERPOLATED if grid == ON_GRID else grid
    log_sum, weight = 0.0, 0.0
    for combo in itertools.product(*corners):
        w = math.prod(wi for _, wi in combo)
        v = values[tuple(i for i, _ in combo)]
        if w > 0 and not np.isnan(v):
            log_sum += w * math.log(v)
            weight += w
    if weight == 0:
        raise TablesUnavailable(f"{what}: no collected point around it")
    return scale * math.exp(log_sum / weight), grid


def _cube(rows: pl.DataFrame, columns: tuple[str, ...]) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The sorted axes of ``columns`` and the median ``latency`` (ms) at each grid point (NaN where missing)."""
    rows = rows.group_by(*columns).agg(pl.col("latency").median())
    axes = tuple(np.array(sorted(rows[c].unique().to_list()), dtype=float) for c in columns)
    cube = np.full(tuple(len(a) for a in axes), np.nan)
    cube[tuple(np.searchsorted(a, rows[c].to_numpy()) for a, c in zip(axes, columns, strict=True))] = (
        rows["latency"].to_numpy())
    return axes, cube


# ------------------------------------------------------------------------------------------ attention

ATTENTION_KERNELS = ("vllm_flash_attn_fa3", "vllm_flash_attn", "vllm_flash_attn_fa2",
                     "vllm_flashinfer_trtllmprefill", "vllm_flashinfer_trtllmdecode")
"""Which attention kernel's rows to read, first present wins: vLLM's FlashAttention backend (FA3 on Hopper, FA2 on
Ampere and Ada, ``vllm_flash_attn`` in the older tables), on Blackwell FlashInfer's TRT-LLM kernels."""


@dataclass
class AttentionTable:
    """vLLM's attention kernel times of one system: ``context`` (a prefill of ``isl`` tokens per sequence) or
    ``generation`` (one decode token per sequence over ``step`` cached tokens), bf16, no sliding window."""

    system: str
    """aiconfigurator system name."""
    version: str
    """vLLM version of the table."""
    phase: str
    """``"context"`` or ``"generation"``."""
    kernel: str
    """The ``kernel_source`` whose rows were read."""
    rows: pl.DataFrame
    """The rows of that kernel (bf16 KV cache, no window)."""
    index: dict = field(default_factory=dict, repr=False, compare=False)
    """(batch, length) grids per head layout, filled on first use."""

    @classmethod
    def load(cls, system: str, phase: str, version: str | None = None) -> AttentionTable:
        """The ``phase`` attention table of ``system`` (newest vLLM version unless named)."""
        kind = f"{phase}_attention"
        path, chosen = table_path(system, kind, version if version in versions(system, kind) else None)
        rows = pl.read_parquet(path)
        # bf16 KV cache, full attention, no beam search (older tables, e.g. a100_sxm's vLLM 0.14.0, have no window)
        wanted = {"kv_cache_dtype": "bfloat16", "window_size": 0, "beam_width": 1}
        rows = rows.filter(*(pl.col(c) == v for c, v in wanted.items() if c in rows.columns))
        have = rows["kernel_source"].unique().to_list()
        kernel = next((k for k in ATTENTION_KERNELS if k in have), None)
        if kernel is None:
            raise TablesUnavailable(f"{system} vLLM {chosen} {phase} attention table has none of "
                                    f"{', '.join(ATTENTION_KERNELS)} (has {sorted(have)})")
        return cls(system=system, version=chosen, phase=phase, kernel=kernel,
                   rows=rows.filter(pl.col("kernel_source") == kernel))

    @property
    def label(self) -> str:
        """Names the table in provenance columns."""
        return f"{self.system} vLLM {self.version} {self.phase} attention ({self.kernel})"

    def latency(self, heads: int, kv_heads: int, head_dim: int, batch: int, length: int) -> Lookup:
        """One attention call of ``batch`` sequences with ``heads`` query and ``kv_heads`` KV heads of ``head_dim``
        on this GPU; ``length`` is the prefill's tokens per sequence (context) or the cached tokens (generation)."""
        key = (heads, kv_heads, head_dim)
        if key not in self.index:
            series = self.rows.filter((pl.col("num_heads") == heads) & (pl.col("num_key_value_heads") == kv_heads)
                                      & (pl.col("head_dim") == head_dim))
            if series.height == 0:
                raise TablesUnavailable(f"{self.label}: no rows for {heads} query / {kv_heads} KV heads of {head_dim}")
            self.index[key] = _cube(series, ("batch_size", "isl" if self.phase == "context" else "step"))
        axes, cube = self.index[key]
        ms, grid = interp_grid(axes, cube, (batch, length), flat_below=(True, True),
                               what=f"{self.label}: batch {batch}, length {length}")
        return Lookup(us=1e3 * ms, grid=grid, table=self.label)


# ------------------------------------------------------------------------------------------ one system's tables


@dataclass(frozen=True)
class SystemTables:
    """The collected tables a prediction for one system reads."""

    system: str
    """aiconfigurator system name."""
    nccl: CollectiveTable
    """NCCL collectives."""
    vllm_all_reduce: VllmAllReduceTable
    """vLLM's all-reduce."""
    gemm: GemmTable | None
    """vLLM's GEMM kernels for the prediction's dtype (``None``: no collected rows for it, e.g. FP8 with tensorwise
    scales; the matmuls are then modelled)."""
    context_attention: AttentionTable | None = None
    """vLLM's prefill attention (``None``: no table; attention is then modelled)."""
    generation_attention: AttentionTable | None = None
    """vLLM's decode attention over a KV cache (``None``: no table)."""

    def describe(self) -> str:
        """One line naming every table and version."""
        gemm = self.gemm.label if self.gemm else "no collected GEMM rows for this dtype (matmuls modelled)"
        attn = self.context_attention.label if self.context_attention else "no attention table (attention modelled)"
        return (f"collected ({PACKAGE} {installed_version()}): {self.nccl.label}; {self.vllm_all_reduce.label}; "
                f"{gemm}; {attn}")


@cache
def system_tables(system: str, dtype: str = "bfloat16", nccl_version: str | None = None,
                  vllm_version: str | None = None) -> SystemTables:
    """The tables of ``system`` (newest versions unless named), loaded once; :class:`TablesUnavailable` saying
    what is missing (and how to install the package) otherwise."""
    return SystemTables(system=system, nccl=CollectiveTable.load(system, nccl_version),
                        vllm_all_reduce=VllmAllReduceTable.load(system, vllm_version),
                        gemm=GemmTable.load(system, dtype, _gemm_version(system, vllm_version))
                        if dtype in GEMM_DTYPES else None,
                        context_attention=_attention(system, "context", vllm_version),
                        generation_attention=_attention(system, "generation", vllm_version))


def _attention(system: str, phase: str, vllm_version: str | None) -> AttentionTable | None:
    """The ``phase`` attention table where the system has one with a kernel sp_lab reads, else ``None``."""
    try:
        return AttentionTable.load(system, phase, vllm_version)
    except TablesUnavailable:
        return None


def _gemm_version(system: str, vllm_version: str | None) -> str | None:
    """The GEMM table's vLLM version: the named one where that GEMM table exists, else the newest (the GEMM and
    all-reduce tables were collected with different vLLM releases on some systems, e.g. a100_sxm's GEMMs 0.14.0)."""
    return vllm_version if vllm_version in versions(system, "gemm") else None
