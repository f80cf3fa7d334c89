"""One decoder layer's predicted time per variant and token count, on a GPU that is not here.

Per layer at ``T`` tokens (padded to a multiple of ``tp`` for the sequence-parallel variants); attention,
embeddings and the LM head are left out (the same in every variant):

- ``baseline``: 4 matmuls on ``T`` rows + 2 all_reduce of ``[T, H]`` + 2 (add +) RMSNorm on ``T`` tokens;
- ``sp``: 4 matmuls + 2 reduce_scatter + 2 all_gather + 2 norms on ``T / tp`` tokens;
- ``sp+async_tp``: each matmul fused with its collective: its chunk pipeline
  (:func:`~sp_lab.tuning.predict.pipeline.run_pipeline`: fill, contention, drain) plus the fused op's own
  cost measured on one H200 (:meth:`~sp_lab.tuning.predict.kernels.KernelModel.fused_overhead_us`);
- ``tuned``: as ``sp``, each matmul fused or not by a :class:`~sp_lab.rules.MatmulRule`, or, with
  ``rule="predicted"``, by the model itself (fused exactly where its fused time is the smaller).

``timing="graph"`` predicts device time (CUDA-graph replay: how sp_lab and vLLM serve); ``"eager"`` adds the
host floor of each call measured on the H200 (an eager fused op costs ~0.2-0.33 ms of host time), for
comparisons with benchmarks that time eager calls. Every row says ``source="predicted"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import polars as pl

from sp_lab.resources import load_preset
from sp_lab.tuning.microbench import MatmulShape, _spec_dims, padded_tokens, tp_matmul_shapes
from sp_lab.tuning.predict import collected
from sp_lab.tuning.predict.collected import Lookup, SystemTables, TablesUnavailable
from sp_lab.tuning.predict.hardware import Gpu, Interconnect, gpu
from sp_lab.tuning.predict.kernels import (
    KernelModel,
    MatmulTable,
    canonical_dtype,
    default_table,
    fused_host_us,
    host_cost_us,
)
from sp_lab.tuning.predict.pipeline import PipelineTiming, run_pipeline
from sp_lab.vocabulary import BASELINE, PREDICTED, SP, SP_ASYNC_TP, TUNED

if TYPE_CHECKING:
    from sp_lab.rules import MatmulRule
    from sp_lab.tuning.microbench import ModelDescription

PREDICTED_RULE = "predicted"
"""``rule=`` value for the per-matmul rule the model implies: fuse a matmul where its fused time is smaller."""
TIMINGS = ("graph", "eager")
"""How the predicted latency is timed: device time under CUDA graphs, or eager calls with their host cost."""


@dataclass(frozen=True)
class MatmulPrediction:
    """One TP matmul with its collective at one token count, fused and unfused (microseconds)."""

    shape: MatmulShape
    """Which matmul (per-rank shape)."""
    tokens: int
    """Rows multiplied (padded to a multiple of tp)."""
    mm_us: float
    """The plain matmul."""
    comm_us: float
    """Its NCCL collective, unfused."""
    pipeline: PipelineTiming
    """The fused kernel's chunk pipeline."""
    overhead_us: float
    """The fused op's own cost (staging, signals, final reduction) from the one-rank H200 measurement."""
    contention: float
    """Matmul slow-down while copies run, used in the pipeline."""
    host_us: dict[str, float]
    """Eager host floors (0 under CUDA graphs): ``"mm"``, ``"fused"``."""
    lookups: tuple[Lookup, ...] = ()
    """The collected-table numbers this prediction used (empty when every term is modelled)."""

    @property
    def unfused_us(self) -> float:
        """Matmul then collective, as separate kernels."""
        return max(self.mm_us, self.host_us["mm"]) + self.comm_us

    @property
    def fused_us(self) -> float:
        """The fused kernel."""
        return max(self.pipeline.total_us + self.overhead_us, self.host_us["fused"])


@dataclass(frozen=True)
class Target:
    """What a prediction is for: GPU, its interconnect, dtype, timing and the contention scale."""

    gpu: Gpu
    """The GPU (datasheet peaks)."""
    interconnect: Interconnect
    """How ranks talk (defaults to the GPU's own)."""
    dtype: str = "bfloat16"
    """Matmul dtype."""
    timing: str = "graph"
    """One of :data:`TIMINGS`."""
    contention_scale: float = 1.0
    """Multiplies (contention - 1): 0 = copies never slow the matmul, 2 = twice the modelled slow-down."""
    tables: SystemTables | None = None
    """Collected multi-GPU tables of the GPU's system (``None``: every communication and matmul term modelled)."""
    tables_note: str = ""
    """Why there are no tables (package missing, system without tables, turned off), with how to get them."""

    @classmethod
    def of(cls, gpu_name: str | Gpu, *, dtype: str = "bfloat16", timing: str = "graph",
           interconnect: Interconnect | None = None, contention_scale: float = 1.0, collected_tables: bool = True,
           nccl_version: str | None = None, vllm_version: str | None = None) -> Target:
        """Target for a GPU name from hardware.json or an aiconfigurator system name (``ValueError`` listing the
        allowed ones). ``collected_tables``: read the system's collected tables where the package is installed
        (NCCL / vLLM versions: the newest unless named); otherwise, and for a GPU without tables, the modelled
        terms stand in and ``tables_note`` says why."""
        g = gpu_name if isinstance(gpu_name, Gpu) else gpu(gpu_name)
        if timing not in TIMINGS:
            raise ValueError(f"unknown timing {timing!r}; expected one of {TIMINGS}")
        key = canonical_dtype(dtype)
        tables, note = None, ""
        if not collected_tables:
            note = "collected tables turned off"
        elif interconnect is not None:  # a what-if interconnect: the system's collected collectives do not apply
            note = f"interconnect set to {interconnect.label} (a what-if): collected tables not used"
        elif g.system is None:
            with_tables = ", ".join(collected.systems_with_tables()) or "none installed"
            note = f"{g.label} has no collected tables (systems with tables: {with_tables})"
        elif not collected.available():
            note = f"collected tables not installed: {collected.INSTALL_HINT}"
        else:
            try:
                tables = collected.system_tables(g.system, key, nccl_version, vllm_version)
            except TablesUnavailable as err:
                if nccl_version or vllm_version:
                    raise ValueError(str(err)) from err
                note = str(err)
        return cls(gpu=g, interconnect=interconnect or g.interconnect, dtype=key, timing=timing,
                   contention_scale=contention_scale, tables=tables, tables_note=note)

    def provenance(self) -> str:
        """Which terms are collected and which modelled, per term."""
        modelled = ("modelled: the fused kernels' own cost (one-rank H200 measurement, scaled), their overlap "
                    "(chunk pipeline and contention; copy-engine transfers at the collected NCCL collective's rate "
                    "where there is a table, else the interconnect's), norms, activation and attention (H200 "
                    "tables scaled by datasheet peaks)")
        if self.tables is None:
            return (f"modelled: matmuls (H200 tables scaled by datasheet peaks) and collectives (alpha-beta, "
                    f"{self.interconnect.label}) -- {self.tables_note}; " + modelled)
        t = self.tables
        mm = f"matmuls {t.gemm.label}" if t.gemm else "matmuls modelled (no collected rows for this dtype)"
        attn = f"; attention {t.context_attention.label}" if t.context_attention else ""
        return (f"collected: {mm}; reduce_scatter / all_gather {t.nccl.label}; baseline all_reduce as vLLM "
                f"picks it ({t.vllm_all_reduce.label} for custom / symm-mem, {t.nccl.label} above){attn}; "
                + (modelled.replace(", activation and attention", " and activation") if attn else modelled))

    def replace(self, **changes: object) -> Target:
        """A copy with some fields changed (the crossover band perturbs bandwidth and contention)."""
        return dataclasses.replace(self, **changes)


def predict_matmul(kernels: KernelModel, target: Target, shape: MatmulShape, tokens: int, tp: int,
                   hidden: int) -> MatmulPrediction:
    """Fused and unfused time of one TP matmul at ``tokens`` (padded to ``tp``) rows."""
    m = padded_tokens(tokens, tp)
    ic = target.interconnect
    act_bytes = kernels.bytes if shape.side == "ag" else 2  # FP8 gathers FP8 inputs; outputs stay bf16
    lookups: list[Lookup] = []
    if target.tables is not None and tp > 1:
        lookups.append(target.tables.nccl.latency(shape.collective, m * hidden * act_bytes, tp, act_bytes))
        comm = lookups[-1].us
    else:
        comm = ic.collective_us(shape.collective, m * hidden * act_bytes, tp)
    gemm = target.tables.gemm if target.tables is not None else None
    if gemm is not None:  # one chunk is one vLLM GEMM of m / tp rows against the whole weight shard
        lookups.append(gemm.latency(max(1, m // tp), shape.n, shape.k))
        chunk = lookups[-1].us
        lookups.append(gemm.latency(m, shape.n, shape.k))
        mm = lookups[-1].us
    else:
        chunk = kernels.chunk_us(m, shape.n, shape.k, tp)
        mm = kernels.mm_us(m, shape.n, shape.k)
    copy_bytes = m // tp * hidden * act_bytes
    if lookups and tp > 1:
        # Copies move the same bytes as the collective they replace: (tp - 1) chunks of S / tp. On a collected
        # system they run at the rate its NCCL collective reached for this tensor -- on PCIe hosts far below the
        # link's datasheet rate -- so the collective's collected time is split over the tp - 1 copies.
        copy = comm / (tp - 1)
        copy_gbps = copy_bytes / (copy * 1e3)
    else:
        copy, copy_gbps = ic.copy_us(copy_bytes), ic.copy_gbps
    kappa = 1.0 + target.contention_scale * (kernels.contention(m // tp, shape.n, shape.k, copy_gbps) - 1.0)
    pipe = run_pipeline([chunk] * tp, [copy] * (tp - 1), shape.side, kappa)
    if target.timing == "eager":
        hosts = {"mm": host_cost_us()["mm"], "fused": fused_host_us(shape.side, tp)}
    else:
        hosts = {"mm": 0.0, "fused": 0.0}
    return MatmulPrediction(shape=shape, tokens=m, mm_us=mm, comm_us=comm,
                            pipeline=pipe, overhead_us=kernels.fused_overhead_us(shape.side, m, shape.n, shape.k, tp),
                            contention=kappa, host_us=hosts, lookups=tuple(lookups))


def plain_mm_us(kernels: KernelModel, target: Target, m: int, n: int, k: int) -> tuple[float, Lookup | None]:
    """One unfused matmul of ``m`` rows: the collected GEMM table where the target has one, else modelled."""
    gemm = target.tables.gemm if target.tables is not None else None
    if gemm is None:
        return kernels.mm_us(m, n, k), None
    hit = gemm.latency(m, n, k)
    return hit.us, hit


def layer_attention_us(kernels: KernelModel, target: Target, tokens: int, q_heads: int, kv_heads: int,
                       head_dim: int) -> tuple[float, Lookup | None]:
    """Causal attention of one ``tokens``-long sequence on one rank: vLLM's prefill attention kernel from the
    collected table where the target has one (and its head layout), else the H200 table scaled (modelled)."""
    table = target.tables.context_attention if target.tables is not None else None
    if table is not None:
        try:
            hit = table.latency(q_heads, kv_heads, head_dim, 1, tokens)
            return hit.us, hit
        except TablesUnavailable:  # a head layout the table lacks: modelled below
            pass
    return kernels.attention_us(tokens, q_heads, head_dim), None


def baseline_all_reduce(target: Target, nbytes: float, tp: int) -> tuple[float, str, Lookup | None]:
    """The baseline's all_reduce of ``nbytes`` bf16 bytes as vLLM runs it: (us, implementation, lookup).

    With collected tables: vLLM's choice (:func:`~sp_lab.tuning.predict.collected.vllm_all_reduce_impl`); the
    custom and symmetric-memory all-reduces read the vLLM table (timed through vLLM's own dispatch, CUDA graph or
    eager as ``target.timing``), NCCL reads the nccl-tests table. Without: the alpha-beta NCCL ring."""
    if tp == 1:
        return 0.0, "none", None
    if target.tables is None:
        return target.interconnect.collective_us("all_reduce", nbytes, tp), "nccl (modelled)", None
    impl = collected.vllm_all_reduce_impl(target.gpu.compute_capability, tp, nbytes, nvlink=target.gpu.nvlink)
    if impl == collected.NCCL:
        hit = target.tables.nccl.latency("all_reduce", nbytes, tp, 2)
    else:
        hit = target.tables.vllm_all_reduce.latency(nbytes, tp, graph=target.timing == "graph")
    return hit.us, impl, hit


def matmul_rows(shapes: Sequence[MatmulShape], token_counts: Iterable[int], tp: int, hidden_size: int,
                target: Target | str = "h200", *, table: MatmulTable | None = None,
                measured_shapes: bool = True) -> pl.DataFrame:
    """Fused and unfused time of each TP matmul at each token count, one row per (matmul, tokens): the
    per-matmul training-row layout a :class:`~sp_lab.rules.MatmulRule` is trained on.

    Columns ``m, n, k, tp, name, side, unfused_us, fused_us, ratio, mm_us, comm_us, chunked_us (the chunk
    matmuls at full speed), overhead_us, estimated (shape not measured: roofline), dtype, gpu, interconnect,
    device_name, source="predicted"``; ``m`` is the token count asked for, times are at ``m`` padded to ``tp``.
    ``measured_shapes=False`` times every shape from the forms fitted to the tables (see :class:`KernelModel`).
    """
    target = Target.of(target) if isinstance(target, str) else target
    if not measured_shapes:  # smooth fitted forms only (fixtures a rule must learn): no table lookups either
        target = target.replace(tables=None, tables_note="fitted forms only (measured_shapes=False)")
    kernels = KernelModel(table or default_table(), target.gpu, target.dtype, measured_shapes=measured_shapes)
    rows = []
    for shape in shapes:
        for t in sorted({int(x) for x in token_counts}):
            p = predict_matmul(kernels, target, shape, t, tp, hidden_size)
            rows.append({"m": t, "n": shape.n, "k": shape.k, "tp": tp, "name": shape.name, "side": shape.side,
                         "unfused_us": p.unfused_us, "fused_us": p.fused_us, "ratio": p.fused_us / p.unfused_us,
                         "mm_us": p.mm_us, "comm_us": p.comm_us, "chunked_us": p.pipeline.compute_us,
                         "overhead_us": p.overhead_us, "estimated": (shape.n, shape.k) in kernels.estimated})
    return pl.DataFrame(rows).with_columns(
        dtype=pl.lit(target.dtype),  # a rule trained on these rows must tell an FP8 matmul from its bf16 twin
        gpu=pl.lit(target.gpu.name), interconnect=pl.lit(target.interconnect.name),
        device_name=pl.lit(f"predicted: {tp}x {target.gpu.label}"), source=pl.lit(PREDICTED))


def model_name(spec: ModelDescription) -> str:
    """A printable name for a preset, spec or config dict."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping):
        return str(spec.get("name") or spec.get("_name_or_path") or "custom")
    return str(getattr(spec, "name", None) or "custom")


def num_layers_of(spec: ModelDescription) -> int:
    """Decoder layers of a preset, spec or config dict (1 when it does not say)."""
    if isinstance(spec, str):
        spec = load_preset(spec)
    if isinstance(spec, Mapping):
        return int(spec.get("num_layers") or spec.get("num_hidden_layers") or 1)
    return int(getattr(spec, "num_layers", 1) or 1)


def predict_layers(
    spec: ModelDescription,
    tp: int,
    token_counts: Iterable[int],
    target: Target | str = "h200",
    *,
    num_layers: int | None = None,
    rule: MatmulRule | str | None = None,
    table: MatmulTable | None = None,
    full_layer: bool = False,
) -> pl.DataFrame:
    """Predicted latency of ``num_layers`` decoder layers per variant and token count.

    ``full_layer=True`` adds what is the same in every variant: each rank's causal attention over one sequence
    of the step's tokens (from the H200 attention table) and the SiLU-and-multiply pass of the MLP; by default
    only what the variants change is predicted. Embeddings and the LM head are never included.

    Returns sweep-store columns: ``num_tokens, variant, latency_us, matmul_us, comm_us, norm_us, n_fused,
    fusion_fired, fusion_missing, model, tp, num_layers, hidden_size, dtype, device_name, device_count, gpu,
    interconnect, source="predicted", timing_method, estimated_shapes, note``.
    """
    target = Target.of(target) if isinstance(target, str) else target
    if isinstance(rule, str) and rule != PREDICTED_RULE:
        raise ValueError(f"rule must be a MatmulRule or {PREDICTED_RULE!r}, got {rule!r}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    kernels = KernelModel(table or default_table(), target.gpu, target.dtype)
    dims = _spec_dims(spec)
    hidden = dims["hidden_size"]
    q_heads = max(1, dims["num_heads"] // tp)
    kv_heads = max(1, dims["num_kv_heads"] // tp)  # replicated below tp
    layers = num_layers or num_layers_of(spec)
    shapes = tp_matmul_shapes(spec, tp)
    ic = target.interconnect
    rows = []
    for t in sorted({int(x) for x in token_counts}):
        if t < 1:
            raise ValueError(f"token counts must be >= 1, got {t}")
        pairs = [predict_matmul(kernels, target, s, t, tp, hidden) for s in shapes]
        m = padded_tokens(t, tp)
        eager_mm = host_cost_us()["mm"] if target.timing == "eager" else 0.0
        plain_hits = [plain_mm_us(kernels, target, t, s.n, s.k) for s in shapes]
        plain = sum(max(us, eager_mm) for us, _ in plain_hits)
        ar_us, ar_impl, ar_hit = baseline_all_reduce(target, t * hidden * 2, tp)
        hits = [h for _, h in plain_hits if h is not None] + [h for p in pairs for h in p.lookups]
        norm_bytes = 4 * hidden * 2  # fused add + RMSNorm: read x and residual, write both, per token
        # same in every variant: attention, and SiLU(gate) * up reading 2 I / tp and writing I / tp per token
        act = kernels.elementwise_us(t * 3 * dims["intermediate_size"] // tp * 2)
        attention = 0.0
        if full_layer:
            attention, attn_hit = layer_attention_us(kernels, target, t, q_heads, kv_heads, dims["head_dim"])
            hits += [attn_hit] if attn_hit is not None else []
        attn = attention + act if full_layer else 0.0
        outside = sorted({f"{h.table}: {h.grid}" for h in [*hits, ar_hit] if h is not None and h.outside})
        choices: dict[str, list[bool] | None] = {BASELINE: None, SP: [False] * 4, SP_ASYNC_TP: [True] * 4}
        if rule == PREDICTED_RULE:
            choices[TUNED] = [p.fused_us < p.unfused_us for p in pairs]
        elif rule is not None:
            choices[TUNED] = [rule.decide(m, s.n, s.k, tp, dtype_bytes=kernels.bytes) == "fuse" for s in shapes]
        for variant, fuse in choices.items():
            if fuse is None:
                matmul = plain
                comm = 2 * ar_us
                norm = 2 * kernels.elementwise_us(t * norm_bytes)
            else:
                matmul = sum(p.fused_us if f else p.unfused_us - p.comm_us for p, f in zip(pairs, fuse, strict=True))
                comm = sum(p.comm_us for p, f in zip(pairs, fuse, strict=True) if not f)
                norm = 2 * kernels.elementwise_us(m // tp * norm_bytes)
            n_fused = sum(fuse or [])
            rows.append({"num_tokens": t, "variant": variant, "latency_us": layers * (matmul + comm + norm + attn),
                         "matmul_us": layers * matmul, "comm_us": layers * comm, "norm_us": layers * norm,
                         "same_in_all_us": layers * attn, "attention_us": layers * attention,
                         "n_fused": n_fused * layers, "fusion_fired": n_fused > 0, "fusion_missing": False,
                         "all_reduce_impl": ar_impl if fuse is None else "-", "outside_grid": "; ".join(outside)})
    estimated = ", ".join(f"{n}x{k}" for n, k in sorted(kernels.estimated)) or "none"
    if target.tables is not None and target.tables.gemm is not None:
        estimated = "none (collected GEMM table)"
    return pl.DataFrame(rows).with_columns(
        model=pl.lit(model_name(spec)), tp=pl.lit(tp), num_layers=pl.lit(layers), hidden_size=pl.lit(hidden),
        dtype=pl.lit(target.dtype), device_name=pl.lit(f"predicted: {tp}x {target.gpu.label}"),
        device_count=pl.lit(tp), gpu=pl.lit(target.gpu.name), interconnect=pl.lit(ic.name),
        source=pl.lit(PREDICTED), timing_method=pl.lit(f"predicted ({target.timing})"),
        estimated_shapes=pl.lit(estimated),
        system=pl.lit(target.gpu.system or target.gpu.name),
        tables=pl.lit("collected" if target.tables is not None else "modelled"),
        provenance=pl.lit(target.provenance()),
        note=pl.lit(("performance model: collected multi-GPU tables (aiconfigurator-core) + modelled fused kernels; "
                     if target.tables is not None else
                     "performance model: H200 kernel tables + alpha-beta communication; ")
                    + ("attention and activation included" if full_layer else "attention excluded")
                    + "; embeddings and LM head excluded"),
    )
