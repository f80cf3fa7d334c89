"""Per-matmul microbenchmarks: the TP matmuls of a model, fused vs unfused.

Every tensor-parallel decoder layer has four matmuls whose neighbouring collective AsyncTP can
fuse (docs/sp-and-async-tp.md):

==========  =================  ============================  =================================
name        side               local weight ``[K, N]``        fused op
==========  =================  ============================  =================================
qkv         all_gather (AG)    ``[H, (nh + 2*nkv)*hd / tp]``  ``fused_all_gather_matmul``
o_proj      reduce_scatter     ``[nh*hd / tp, H]``            ``fused_matmul_reduce_scatter``
gate_up     all_gather (AG)    ``[H, 2*I / tp]``              ``fused_all_gather_matmul``
down        reduce_scatter     ``[I / tp, H]``                ``fused_matmul_reduce_scatter``
==========  =================  ============================  =================================

``M`` is always the **total** token count of the step (the rows of the full activation): an AG-side
fused op receives an ``[M/tp, K]`` shard and produces ``[M, N]``; an RS-side one receives ``[M, K]``
and produces an ``[M/tp, N]`` shard. Both kernels split the M rows into ``tp`` chunks.

Timing follows docs/measured-h200.md: called eagerly, a symmetric-memory fused op costs 0.2-0.33 ms of
host time, which swamps the kernel at decode sizes, so CUDA timings replay a CUDA graph of several
calls and take the median per-call time (``sp_lab.bench.timing``). Nothing imported at the top here (nor in
``sp_lab.tuning``'s ``__init__``, which importing this runs) needs polars, so that ``benchmarks/bench_matmul_h200.py``
runs on machines without it (tests/test_tuning_train.py checks); DataFrames are built lazily.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from sp_lab.bench.timing import TIMING_METHODS, time_fn
from sp_lab.resources import load_preset
from sp_lab.vocabulary import MEASURED

if TYPE_CHECKING:
    import polars as pl
    from torch.distributed import ProcessGroup

    from sp_lab.models.llama import ModelSpec

    ModelDescription = str | ModelSpec | Mapping[str, Any]
    """A preset name, a built model's ``spec``, or an HF-style config dict."""

#: Matmuls whose fusable collective is an all_gather before them (column-parallel).
AG_SIDE = ("qkv", "gate_up")
#: Matmuls whose fusable collective is a reduce_scatter after them (row-parallel).
RS_SIDE = ("o_proj", "down")



@dataclass(frozen=True)
class MatmulShape:
    """One per-rank TP matmul ``[M, K] @ [K, N]`` of a decoder layer (M varies with the batch)."""

    name: str
    """Which matmul: ``"qkv"``, ``"o_proj"``, ``"gate_up"`` or ``"down"``."""
    n: int
    """Output columns of the local weight shard (N)."""
    k: int
    """Reduction dimension of the local weight shard (K)."""
    collective: str
    """The collective AsyncTP fuses with it: ``"all_gather"`` (before) or ``"reduce_scatter"`` (after)."""

    @property
    def side(self) -> str:
        """``"ag"`` for all_gather+matmul, ``"rs"`` for matmul+reduce_scatter."""
        return "ag" if self.collective == "all_gather" else "rs"


def _spec_dims(spec: ModelDescription) -> dict[str, int]:
    """Normalise a model description to hidden/intermediate/heads/kv_heads/head_dim ints.

    Accepts a ``ModelSpec`` (attributes ``num_heads``/``num_kv_heads``), an HF-style dict
    (``num_attention_heads``/``num_key_value_heads``), or a preset name looked up in
    ``data/models/<name>.json``.
    """
    if isinstance(spec, str):
        spec = load_preset(spec)
    if not isinstance(spec, Mapping):
        spec = spec.to_dict() if hasattr(spec, "to_dict") else vars(spec)
    aliases = {
        "hidden_size": ("hidden_size",),
        "intermediate_size": ("intermediate_size",),
        "num_heads": ("num_attention_heads", "num_heads"),
        "num_kv_heads": ("num_key_value_heads", "num_kv_heads"),
        "head_dim": ("head_dim",),
    }
    dims: dict[str, int] = {}
    for key, names in aliases.items():
        value = next((spec[n] for n in names if spec.get(n) is not None), None)
        if value is None and key == "num_kv_heads":
            value = dims["num_heads"]  # no GQA field means plain multi-head attention
        if value is None and key == "head_dim":
            value = dims["hidden_size"] // dims["num_heads"]
        if value is None:
            raise ValueError(f"model spec lacks {names[0]!r} (accepted names: {names}); got keys {sorted(spec)}")
        dims[key] = int(value)
    return dims


def tp_matmul_shapes(spec: ModelDescription, tp: int) -> list[MatmulShape]:
    """The four fusable per-rank matmul shapes of one decoder layer at tensor-parallel size ``tp``.

    Args:
        spec: a ``ModelSpec``, a dict with ``hidden_size``, ``intermediate_size``,
            ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, or a preset name.
        tp: tensor-parallel size; must divide the attention heads and the intermediate size.

    KV heads fewer than ``tp`` are replicated (one per rank), as vLLM does.
    """
    d = _spec_dims(spec)
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    for key in ("num_heads", "intermediate_size"):
        if d[key] % tp:
            raise ValueError(f"tp={tp} does not divide {key}={d[key]}; pick a tp among its divisors")
    heads, hd = d["num_heads"] // tp, d["head_dim"]
    kv_heads = max(1, d["num_kv_heads"] // tp)
    hidden, inter = d["hidden_size"], d["intermediate_size"] // tp
    return [
        MatmulShape("qkv", n=(heads + 2 * kv_heads) * hd, k=hidden, collective="all_gather"),
        MatmulShape("o_proj", n=hidden, k=heads * hd, collective="reduce_scatter"),
        MatmulShape("gate_up", n=2 * inter, k=hidden, collective="all_gather"),
        MatmulShape("down", n=hidden, k=inter, collective="reduce_scatter"),
    ]


def padded_tokens(m: int, tp: int) -> int:
    """Tokens after padding ``m`` up to a multiple of ``tp`` (what the SP rewrite does before a reduce_scatter)."""
    return -(-m // tp) * tp


# ----------------------------------------------------------------------------------- fused / unfused

#: ``fused(a, b, shape) -> out``: ``a`` is what the fused op receives: the ``[M/tp, K]`` shard on the
#: AG side, the full ``[M, K]`` input on the RS side; ``b`` is the ``[K, N]`` local weight.
FusedMatmul = Callable[[torch.Tensor, torch.Tensor, MatmulShape], torch.Tensor]


def symm_mem_fused_impl(group_name: str) -> FusedMatmul:
    """The CUDA symmetric-memory fused ops on process group ``group_name`` (symm_mem must be enabled)."""

    def fused(a: torch.Tensor, b: torch.Tensor, shape: MatmulShape) -> torch.Tensor:
        if shape.side == "ag":
            _, outs = torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group_name, return_A=False)
            return outs[0]
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)

    return fused


def _default_fused_impl(device: torch.device, group_name: str | None, tp: int) -> FusedMatmul:
    if group_name is None:
        raise ValueError(
            f"measuring fused ops on {device} needs group_name= of the TP process group (on CUDA with "
            "symmetric memory enabled: sp_lab.distributed.collectives.maybe_enable_symm_mem), or fused_impl="
        )
    if device.type == "cuda":
        return symm_mem_fused_impl(group_name)
    # The CPU chunked ops live in the compiler layer, below this one; imported lazily (registers custom ops).
    from sp_lab.compiler import fused_ops

    def fused(a: torch.Tensor, b: torch.Tensor, shape: MatmulShape) -> torch.Tensor:
        if shape.side == "ag":
            return fused_ops.fused_all_gather_matmul(a, b, group_name, tp)
        return fused_ops.fused_matmul_reduce_scatter(a, b, group_name, tp)

    return fused


def _unfused_impl(group: ProcessGroup | None, tp: int) -> FusedMatmul:
    """all_gather -> mm, or mm -> reduce_scatter, on ``group``; a plain mm when there is no peer."""
    import torch.distributed as dist

    from sp_lab.distributed.collectives import all_gather_single, reduce_scatter_single

    world = dist.get_world_size(group) if group is not None else 1

    def unfused(a: torch.Tensor, b: torch.Tensor, shape: MatmulShape) -> torch.Tensor:
        if world == 1:
            return a @ b
        if shape.side == "ag":
            full = a.new_empty(a.shape[0] * world, a.shape[1])
            all_gather_single(full, a, group=group)
            return full @ b
        out = a @ b
        shard = out.new_empty(out.shape[0] // world, out.shape[1])
        reduce_scatter_single(shard, out, group=group)
        return shard

    return unfused


def provenance(device: torch.device | str) -> dict[str, str]:
    """Device name, torch and CUDA versions and a UTC timestamp, attached to every measured row."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    return {
        "device": name,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def measure_matmuls(
    shapes: Sequence[MatmulShape],
    token_counts: Iterable[int],
    tp: int,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    fused_impl: FusedMatmul | None = None,
    unfused_impl: FusedMatmul | None = None,
    group: ProcessGroup | None = None,
    group_name: str | None = None,
    calls: int | None = None,
    replays: int = 5,
    seed: int = 0,
) -> pl.DataFrame:
    """Time the unfused and the fused form of each TP matmul at each token count.

    Args:
        shapes: per-rank shapes (``tp_matmul_shapes``).
        token_counts: total tokens M per step; each is padded up to a multiple of ``tp``.
        tp: tensor-parallel size of the shapes (and of ``group`` when one is given).
        device: ``"cuda"`` times CUDA-graph replays; anything else times wall clock. The ``timer`` column
            says which (``sp_lab.bench.timing.TIMING_METHODS``; ``cuda_events`` where a capture failed).
        fused_impl: ``fused(a, b, shape)`` (see :data:`FusedMatmul`); default: the symm_mem ops on
            CUDA, ``sp_lab.compiler.fused_ops`` elsewhere. Tests pass a stand-in.
        unfused_impl: same signature; default: collective + ``mm`` on ``group`` (plain ``mm`` without one).
        group, group_name: the process group the collectives run on.

    Returns:
        One row per (shape, M): ``m, m_padded, n, k, tp, name, side, unfused_us, fused_us, ratio``
        (fused / unfused; < 1 means fusion pays), ``error``, and provenance ``device, torch, cuda,
        date, dtype, timer, source="measured"``.
    """
    import polars as pl  # kept lazy: see module docstring

    device = torch.device(device)
    fused_impl = fused_impl or _default_fused_impl(device, group_name, tp)
    unfused_impl = unfused_impl or _unfused_impl(group, tp)
    on_cuda = device.type == "cuda"
    prov = provenance(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = []
    for shape in shapes:
        b = torch.randn(shape.k, shape.n, generator=gen, dtype=torch.float32).to(device, dtype)
        for m in token_counts:
            m_pad = padded_tokens(m, tp)
            a_full = torch.randn(m_pad, shape.k, generator=gen, dtype=torch.float32).to(device, dtype)
            # The fused AG op sees this rank's shard; the RS op the full partial-sum input.
            a_fused = a_full[: m_pad // tp] if shape.side == "ag" else a_full
            a_unfused = a_fused
            n_calls = calls or (10 if on_cuda else max(1, min(5, int(2e8 // max(1, m_pad * shape.k * shape.n)))))
            row: dict[str, Any] = {"m": m, "m_padded": m_pad, "n": shape.n, "k": shape.k, "tp": tp,
                                   "name": shape.name, "side": shape.side, "unfused_us": None,
                                   "fused_us": None, "error": None, "timer": None}
            try:
                unfused, fused = (
                    time_fn(partial(impl, a, b, shape), device=device, warmup=2, repeats=replays, calls=n_calls,
                            barrier=False)
                    for impl, a in ((unfused_impl, a_unfused), (fused_impl, a_fused)))
                row["unfused_us"], row["fused_us"] = unfused.median_us, fused.median_us
                # the weaker method of the two: an eager fallback carries host overhead into the ratio
                row["timer"] = min(unfused.method, fused.method, key=TIMING_METHODS.index)
            except Exception as exc:  # noqa: BLE001  (one failing shape must not lose the others)
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            rows.append(row)
    df = pl.DataFrame(rows, schema_overrides={"unfused_us": pl.Float64, "fused_us": pl.Float64, "error": pl.Utf8,
                                              "timer": pl.Utf8})
    return df.with_columns(
        ratio=pl.col("fused_us") / pl.col("unfused_us"),
        dtype=pl.lit(str(dtype).removeprefix("torch.")),
        source=pl.lit(MEASURED),
        **{k: pl.lit(v) for k, v in prov.items()},
    )


def tflops(m: int, n: int, k: int, us: float) -> float:
    """Achieved TFLOP/s of an ``[m,k] @ [k,n]`` matmul that took ``us`` microseconds."""
    return 2.0 * m * n * k / (us * 1e-6) / 1e12 if us and not math.isnan(us) else float("nan")
