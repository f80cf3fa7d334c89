"""The performance model against published multi-GPU figures: one table, one command.

``python -m sp_lab predict --validate`` prints it (and ``--write docs/predictions.md`` regenerates the docs
page). The figures, their sources and how each setup differs from what the model computes are data
(``data/published_figures.json``); none of them calibrates the model, which is built only from the
H200 tables and the datasheet / nccl-tests hardware constants.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cache
from typing import Any

import polars as pl

from sp_lab.resources import DATA_DIR
from sp_lab.tuning.microbench import MatmulShape, _spec_dims, tp_matmul_shapes
from sp_lab.tuning.predict.collected import TablesUnavailable
from sp_lab.tuning.predict.crossover import predicted_crossover
from sp_lab.tuning.predict.kernels import KernelModel, default_table
from sp_lab.tuning.predict.layer import Target, predict_layers, predict_matmul

FIGURES_JSON = DATA_DIR / "published_figures.json"
"""The published figures with their sources."""

SPEEDUP_TOLERANCE = 0.15
"""A predicted speedup within +-15% of the published one counts as a hit."""
OUTSIDE_NOTE = "beyond the collected grid: scaled from its edge"
"""A figure's note when a collected-table lookup left the table's grid."""
CROSSOVER_FACTOR = 2.0
"""A predicted crossover within a factor of 2 of the published one counts as a hit."""


@dataclass(frozen=True)
class Figure:
    """One published figure and the setup it was measured on."""

    id: str
    """Short key."""
    claim: str
    """What the source says, in our words."""
    source_title: str
    """The public source."""
    source_url: str
    """Where to read it."""
    setup: dict[str, Any]
    """gpu, model or shapes, tp, dtype, timing, quantity and its arguments (see the JSON's meta)."""
    published: float
    """The published value."""
    unit: str
    """``"x"`` (speedup), ``"us"`` or ``"tokens"``."""
    differences: str
    """How the published setup differs from what the model computes."""


@cache
def figures() -> tuple[Figure, ...]:
    """The shipped published figures."""
    raw = json.loads(FIGURES_JSON.read_text())["figures"]
    keys = ("id", "claim", "source", "published", "unit", "differences")
    return tuple(Figure(id=f["id"], claim=f["claim"], source_title=f["source"]["title"], source_url=f["source"]["url"],
                        setup={k: v for k, v in f.items() if k not in keys}, published=float(f["published"]),
                        unit=f["unit"], differences=f["differences"]) for f in raw)


def _shapes(setup: dict[str, Any]) -> tuple[list[MatmulShape], int]:
    if "shapes" in setup:
        return [MatmulShape(s["name"], n=s["n"], k=s["k"], collective=s["collective"]) for s in setup["shapes"]], int(
            setup["hidden"])
    model = setup["model"]
    shapes = [s for s in tp_matmul_shapes(model, setup["tp"]) if s.name in setup["matmuls"]]
    return shapes, _spec_dims(model)["hidden_size"]


def predict_figure(fig: Figure) -> tuple[float | None, str]:
    """The model's value for ``fig``'s setup, and a note (the crossover band, or why there is none)."""
    s = fig.setup
    target = Target.of(s["gpu"], dtype=s.get("dtype", "bfloat16"), timing=s.get("timing", "graph"))
    quantity = s["quantity"]
    try:
        if quantity in ("fused_speedup", "fused_added_us"):
            kernels = KernelModel(default_table(), target.gpu, target.dtype)
            shapes, hidden = _shapes(s)
            preds = [predict_matmul(kernels, target, shape, s["tokens"], s["tp"], hidden) for shape in shapes]
            unfused, fused = sum(p.unfused_us for p in preds), sum(p.fused_us for p in preds)
            note = "roofline estimate for unmeasured shapes" if kernels.estimated else ""
            if any(h.outside for p in preds for h in p.lookups):
                note = OUTSIDE_NOTE
            return (unfused / fused if quantity == "fused_speedup" else fused - unfused), note
        if quantity == "layer_speedup":
            rows = predict_layers(s["model"], s["tp"], [s["tokens"]], target, num_layers=1, full_layer=True)
            t = dict(zip(rows["variant"], rows["latency_us"], strict=True))
            return t[s["against"]] / t[s["variant"]], OUTSIDE_NOTE if any(rows["outside_grid"]) else ""
        if quantity == "crossover_tokens":
            c = predicted_crossover(s["model"], s["tp"], target, variant=s["variant"], against=s["against"])
            band = f"band {c.low if c.low is not None else '-'}-{c.high if c.high is not None else 'none'}"
            return (None if c.tokens is None else float(c.tokens)), band
    except ValueError as err:  # e.g. FP8 without a measured FP8 table: not predicted, and said why
        return None, f"not predicted: {err}"
    raise ValueError(f"figure {fig.id!r}: unknown quantity {quantity!r}")


def _us(x: float) -> str:
    return f"{x:.0f} us" if x >= 10 else f"{x:.1f} us"


def _device_terms(preds: list[Any], tp: int) -> str:
    """The fused calls' device time, term by term, beside one plain matmul of all rows."""
    def total(f: Any) -> float:
        return sum(f(p) for p in preds)
    return (f"{tp} chunk matmuls {_us(total(lambda p: p.pipeline.compute_us))} (one matmul of all rows: "
            f"{_us(total(lambda p: p.mm_us))}), waiting for copies {_us(total(lambda p: p.pipeline.stall_us))}, "
            f"contention {_us(total(lambda p: p.pipeline.contention_us))}, drain "
            f"{_us(total(lambda p: p.pipeline.drain_us))}, the fused op's own cost {_us(total(lambda p: p.overhead_us))}")


def miss_breakdown(fig: Figure) -> str:
    """What the model's value for ``fig`` is made of, term by term (for reading a miss): per fused call the
    plain matmul, collective and host floor against the chunk matmuls, pipeline fill, contention, drain, the fused
    op's own cost and its host floor; per layer the variants' totals and the same fused terms. Same inputs as
    :func:`predict_figure`; nothing here is fitted."""
    s = fig.setup
    target = Target.of(s["gpu"], dtype=s.get("dtype", "bfloat16"), timing=s.get("timing", "graph"))
    try:
        kernels = KernelModel(default_table(), target.gpu, target.dtype)
    except ValueError:
        return ""
    if s["quantity"] in ("fused_speedup", "fused_added_us"):
        shapes, hidden = _shapes(s)
        preds = [predict_matmul(kernels, target, shape, s["tokens"], s["tp"], hidden) for shape in shapes]

        def total(f: Any) -> float:
            return sum(f(p) for p in preds)
        device = total(lambda p: p.pipeline.total_us + p.overhead_us)
        host_fused = total(lambda p: p.host_us["fused"])
        text = (f"{' + '.join(p.shape.name for p in preds)} at M = {s['tokens']} on {target.gpu.label}, "
                f"{target.timing} timing: unfused {_us(total(lambda p: p.unfused_us))} = matmul "
                f"{_us(total(lambda p: p.mm_us))}"
                + (f" (host floor {_us(total(lambda p: p.host_us['mm']))})" if target.timing == "eager" else "")
                + f" + {shapes[0].collective} {_us(total(lambda p: p.comm_us))}; fused {_us(total(lambda p: p.fused_us))}"
                + (f" = host floor {_us(host_fused)} (device time {_us(device)})" if host_fused > device else "")
                + f"; device time: {_device_terms(preds, s['tp'])}")
        if target.timing == "eager":
            graph, _ = predict_figure(dataclasses.replace(fig, setup={**s, "timing": "graph"}))
            text += f". Timed as device time (CUDA graphs) instead: {_fmt(graph, fig.unit)}"
        return text + "."
    if s["quantity"] == "layer_speedup":
        rows = predict_layers(s["model"], s["tp"], [s["tokens"]], target, num_layers=1, full_layer=True)
        r = {row["variant"]: row for row in rows.iter_rows(named=True)}
        a, b = r[s["against"]], r[s["variant"]]
        hidden = _spec_dims(s["model"])["hidden_size"]
        preds = [predict_matmul(kernels, target, shape, s["tokens"], s["tp"], hidden)
                 for shape in tp_matmul_shapes(s["model"], s["tp"])]
        return (f"one {s['model']} layer at {s['tokens']} tokens on {s['tp']}x {target.gpu.label}: {s['against']} "
                f"matmuls {_us(a['matmul_us'])} + collectives {_us(a['comm_us'])} + norms {_us(a['norm_us'])}; "
                f"{s['variant']} fused calls {_us(b['matmul_us'])} + norms {_us(b['norm_us'])}, the fused calls being "
                f"{_device_terms(preds, s['tp'])}; attention and activation {_us(a['same_in_all_us'])} in both.")
    if s["quantity"] == "crossover_tokens":
        tokens = int(fig.published)  # the layer's terms at the published threshold, where the two should meet
        rows = predict_layers(s["model"], s["tp"], [tokens], target, num_layers=1)
        r = {row["variant"]: row for row in rows.iter_rows(named=True)}
        a, b = r[s["against"]], r[s["variant"]]
        hidden = _spec_dims(s["model"])["hidden_size"]
        preds = [predict_matmul(kernels, target, shape, tokens, s["tp"], hidden)
                 for shape in tp_matmul_shapes(s["model"], s["tp"])]
        text = (f"one {s['model']} layer at the published {tokens} tokens on {s['tp']}x {target.gpu.label} "
                f"({'collected' if target.tables else 'modelled'} tables, {target.timing} timing): {s['against']} "
                f"matmuls {_us(a['matmul_us'])} + all_reduce {_us(a['comm_us'])} ({a['all_reduce_impl']}) + norms "
                f"{_us(a['norm_us'])} = {_us(a['latency_us'])}; {s['variant']} fused calls {_us(b['matmul_us'])} + "
                f"norms {_us(b['norm_us'])} = {_us(b['latency_us'])}, the fused calls being "
                f"{_device_terms(preds, s['tp'])}")
        if target.timing == "eager":
            device = sum(p.pipeline.total_us + p.overhead_us for p in preds)
            host = sum(p.host_us["fused"] for p in preds)
            graph, _ = predict_figure(dataclasses.replace(fig, setup={**s, "timing": "graph"}))
            text += (f"; their host time {_us(host)} against that device time {_us(device)}. Timed as device time "
                     f"(CUDA graphs) instead, the crossover is {_fmt(graph, fig.unit)}")
        return text + "."
    return ""


def _verdict(fig: Figure, predicted: float | None) -> tuple[float | None, str]:
    if predicted is None:
        return None, "not predicted"
    if fig.unit == "tokens":
        ratio = predicted / fig.published
        return ratio - 1.0, "hit" if 1 / CROSSOVER_FACTOR <= ratio <= CROSSOVER_FACTOR else "miss"
    error = predicted / fig.published - 1.0
    if fig.setup.get("published_is") == "lower_bound":
        # the model's quantity is at least the published one: under it, the true error is this or worse;
        # at or above it, the prediction is consistent with the figure
        return error, "hit" if error >= 0 else "undecided" if error >= -SPEEDUP_TOLERANCE else "miss"
    return error, "hit" if abs(error) <= SPEEDUP_TOLERANCE else "miss"


def validation_table() -> pl.DataFrame:
    """One row per published figure: ``id, claim, gpu, published, predicted, unit, error, verdict, note,
    differences, source, url``. ``error`` is predicted / published - 1."""
    rows = []
    for fig in figures():
        predicted, note = predict_figure(fig)
        error, verdict = _verdict(fig, predicted)
        rows.append({"id": fig.id, "claim": fig.claim, "gpu": fig.setup["gpu"], "published": fig.published,
                     "predicted": predicted, "unit": fig.unit, "error": error, "verdict": verdict, "note": note,
                     "differences": fig.differences, "source": fig.source_title, "url": fig.source_url})
    return pl.DataFrame(rows, schema_overrides={"predicted": pl.Float64, "error": pl.Float64})


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "x":
        return f"{value:.2f}x"
    return f"{value:.0f} {unit}"


def validation_markdown(table: pl.DataFrame) -> str:
    """The table as markdown: value, prediction, error and verdict per figure, then each figure's source and
    how its setup differs."""
    lines = ["| figure | GPU | published | predicted | error | verdict |", "|---|---|---|---|---|---|"]
    for r in table.iter_rows(named=True):
        err = "-" if r["error"] is None else f"{100 * r['error']:+.0f}%"
        pred = _fmt(r["predicted"], r["unit"]) + (f" ({r['note']})" if r["note"] else "")
        lines.append(f"| {r['claim']} [{r['id']}] | {r['gpu']} | {_fmt(r['published'], r['unit'])} | {pred} | "
                     f"{err} | {r['verdict']} |")
    hits = table.filter(pl.col("verdict") == "hit").height
    undecided = table.filter(pl.col("verdict") == "undecided").height
    judged = table.filter(pl.col("verdict") != "not predicted").height
    lines += ["", (f"{hits} of {judged} predicted figures within target (speedups +-{100 * SPEEDUP_TOLERANCE:.0f}%, "
              f"crossovers within {CROSSOVER_FACTOR:.0f}x)"
              + (f"; {undecided} undecided: under a published value that is only a lower bound for the model's "
                 "quantity (a training step gains less than its decoder layers), so at least that far low" if undecided
                 else "") + "."), "", "Sources and how each setup differs:", ""]
    for r in table.iter_rows(named=True):
        lines.append(f"- **{r['id']}**: [{r['source']}]({r['url']}). {r['differences']}")
    misses = {r["id"] for r in table.iter_rows(named=True) if r["verdict"] in ("miss", "undecided")}
    # crossovers always: their timing (eager, as vLLM runs those sizes) is a choice the reader should see undone
    made_of = [(f.id, miss_breakdown(f)) for f in figures()
               if f.id in misses or f.setup["quantity"] == "crossover_tokens"]
    if any(text for _, text in made_of):
        lines += ["", ("What each missed or undecided prediction, and each crossover, is made of (the model's own "
                       "terms, same inputs):"), ""]
        lines += [f"- **{fid}**: {text}" for fid, text in made_of if text]
    return "\n".join(lines) + "\n"


_PAGE_HEAD = """# Predictions: SP and AsyncTP on GPUs you do not have

`python -m sp_lab predict --model llama-3-70b --tp 8 --gpu h200` prints predicted latency curves per variant,
where SP + AsyncTP starts to pay (with a band) and the config that suggests, every line labelled
`source: predicted`. The tuner can overlay the same curves (dashed, "predicted" legend group, never in the
regret), `make run`'s report shows them for a real preset, and a predicted config is exported only on purpose
(`--export-predicted DIR`; the file says `source: predicted`). Measured rows always decide: run a sweep on the
GPUs before trusting a threshold.

This page is generated: `python -m sp_lab predict --validate --write docs/predictions.md`.

## What the model computes

Per decoder layer and token count T (padded to a multiple of tp for the SP variants):

- **baseline**: the four TP matmuls on T rows, two NCCL all_reduce of `[T, H]`, two fused add + RMSNorm on T tokens;
- **sp**: the same matmuls, two reduce_scatter and two all_gather, norms on T / tp tokens;
- **sp+async_tp**: each matmul fused with its collective, simulated chunk by chunk: tp row chunks, one
  copy-engine transfer per remote chunk; on the all_gather side the local chunk is multiplied first and chunk
  i waits for its copy (pipeline fill and bubbles), on the reduce_scatter side each chunk's partial result is
  sent while the next is computed and whatever copy is left after the last matmul is the drain. While a copy
  runs the matmul is slowed by a contention factor (below). Added to that: the fused op's own cost;
- **tuned**: as sp, each matmul fused or not by a per-matmul rule.

Ingredients, and where each comes from. **Collected** where NVIDIA's `aiconfigurator-core` 0.12.0 is installed
(`pip install "sp_lab[tables]"`, part of the `dev` extra `make install` uses; an ~80 MB wheel for Linux and
macOS, Python 3.11-3.13): tables its collector timed on real 8-GPU systems, read with polars from
`aiconfigurator_core/systems/data/<system>/` for the systems `--gpu` names (`h100_sxm`, `h200_sxm`, `b200_sxm`,
`b300_sxm`, `a100_sxm`, `l40s`, `rtx_pro_6000_server`, and `gb200` / `gb300` up to tp 4, where their NCCL rows stop;
`h100`, `h200`, `b200` are aliases), newest NCCL / vLLM version unless `--nccl-version` / `--vllm-version` names
one:

- **Matmuls at the shard shapes** (plain and each fused kernel's tp chunk of T / tp rows): vLLM's own GEMM
  kernels (`gemm/vllm/<version>/gemm_perf.parquet`: `F.linear` bf16, CUTLASS scaled-mm FP8), interpolated in
  log-log between the grid's (m, n, k) points; a shape outside the grid is scaled from its edge and named in the
  rows' `outside_grid` column.
- **reduce_scatter / all_gather**: nccl-tests (`comm/nccl/<version>/nccl_perf.parquet`). Its `message_size`
  counts elements (the collector stores `bytes // bytes_per_element`: 2 for `half`, 1 for `int8`) of the whole
  tensor; FP8 all_gathers read the `int8` rows.
- **The baseline's all_reduce as vLLM runs it**: vLLM's `CudaCommunicator.all_reduce` tries its custom
  all-reduce first (`should_custom_ar`: 2 GPUs or NVLink, tensor below `CustomAllreduce`'s `max_size`, 8 MiB,
  lowered per compute capability and GPU count by `CUSTOM_ALL_REDUCE_MAX_SIZES` in
  `vllm/distributed/device_communicators/all_reduce_utils.py` while PyTorch symmetric memory is on, the default:
  on SM 9.0 at 8 GPUs 256 KiB), then PyTorch's symmetric-memory all-reduce below `SYMM_MEM_ALL_REDUCE_MAX_SIZES`
  (SM 9.0, 8 GPUs: 64 MiB), then NCCL. Custom and symmetric-memory sizes read the vLLM table
  (`comm/vllm/<version>/custom_allreduce_perf.parquet`, timed through vLLM's own dispatch, CUDA graph or eager
  as the prediction's timing); NCCL sizes the nccl-tests table. On more than two PCIe-only GPUs vLLM disables
  the custom all-reduce.
- **The fused kernels' copies**: as many bytes as the collective they replace, at the rate the collected NCCL
  collective reached for that tensor (its time over the tp - 1 copies): on PCIe hosts far below the link's
  datasheet rate.
- **Attention** (whole-layer predictions): vLLM's prefill attention kernel over one sequence of the step's tokens
  (`attention/vllm/<version>/context_attention_perf.parquet`: FlashAttention 3 on Hopper, 2 on Ampere and Ada,
  FlashInfer's TRT-LLM kernels on Blackwell), each rank's heads; the AIConfigurator cross-check's decode steps read
  the decode kernel's table (`generation_attention_perf.parquet`) over the KV cache.

What stays **modelled** everywhere (each row's `provenance` column says it per term): the fused kernels' own cost
and the overlap inside them (below), norms and activation. Without the package, or for a GPU without
tables (`h100_pcie`, whose directory in the package holds none, `h800`, `h100-hbm2e`), every term is modelled as
follows and the prediction says so:

- **Matmul and chunked-matmul times**: measured on one H200 at the shard shapes (bf16, CUDA-graph replay,
  `data/h200/matmul_single_gpu.json`, `gemm_chunking_tp8.json`). Shapes not measured come from a
  roofline fitted to those rows (floor + max(FLOPs / peak, bytes / bandwidth)), and are flagged.
- **The fused op's own cost**: PyTorch's symmetric-memory fused ops timed on a one-rank group on the H200 (no
  peer, so no communication): fused minus plain matmul. The all_gather side stages the local `[T / tp, K]`
  shard (read at T / tp rows). The reduce_scatter side sums its partials (read at T rows), but not as a tp-rank
  op does: on one rank torch sums `[1, T, N]` over a dimension of one, far below the HBM rate, where a tp-rank
  op sums `[tp, T / tp, N]` near it. Both sums and the one-rank op were timed in one run on one H100
  (`benchmarks/bench_rs_reduction.py`, `data/h100/rs_reduction.json`: the one-rank own cost is that sum to
  within a microsecond at T = N = 8192), and the one-rank cost is scaled by the measured ratio of the tp-rank
  own cost to it (at tp 8: 0.52 at T = 512 down to 0.20 at T = 32768). For unmeasured shapes a line
  `fixed + bytes / rate` fitted per side to the same rows, scaled alike.
- **Eager host cost** (only for predictions timed as eager calls): the same one-rank ops called eagerly
  (`symm_mem_ws1.json`: ~0.2-0.33 ms per fused call), plus what a one-rank group never runs: the op calls
  PyTorch's fused ops issue per remote chunk (`torch/distributed/_symmetric_memory/__init__.py`: the
  all_gather side a copy and a chunk matmul, the reduce_scatter side a chunk matmul, a barrier, a copy and a
  second barrier, and one sleep launch), each at the host time of one eager op call (the plain matmul at the
  smallest M measured, where the device finishes first: 15.6 us). At tp 8: ~0.55 ms per all_gather-side and
  ~0.65 ms per reduce_scatter-side call. vLLM runs eagerly above its largest CUDA-graph size (default
  min(2 x max_num_seqs, 512) tokens), so its SP thresholds are predicted with eager timing.
- **Attention** (whole-layer predictions): `sp_lab::attention` on the H200 (`attention.json`, 32 heads of 128),
  in proportion to each rank's heads.
- **Other GPUs**: each H200 time split into its memory-bound and compute-bound share (from the roofline fit)
  and scaled by the datasheet HBM-bandwidth and matmul-peak ratios (`data/hardware.json`).
- **Communication**: alpha-beta per interconnect, `alpha + f * bytes / busbw` with nccl-tests' bus-bandwidth
  factors (2(tp-1)/tp for all_reduce, (tp-1)/tp for reduce_scatter and all_gather); a copy-engine transfer
  costs `copy_alpha + bytes / copy_bw`. NVLink 4 (H100, H200): 450 GB/s per direction (datasheets), busbw and
  copy bandwidth assumed 360 GB/s (80%, NVLink SHARP off; public nccl-tests runs with it on reach 460-480 GB/s);
  H800: 200 GB/s per direction; NVLink 5 (B200): 900 GB/s per direction; PCIe Gen5 x16: busbw 40 GB/s (public
  nccl-tests range 35-45 GB/s). Alphas (10 us per NCCL collective, 2 us per copy) are assumptions.
- **Contention** (the matmul slowed while copies run): each GPU sends and receives, so copies take
  `2 * copy_bw` of its HBM bandwidth; a chunk matmul slows by `1 + m * s / (1 - s)`, with `s` that share of the
  datasheet HBM bandwidth and `m` the chunk's memory-bound share from the roofline fit. On 8x H200 with NVLink 4:
  s = 0.15, so up to 1.18x for a memory-bound chunk and ~1.0x for a compute-bound one. It is derived, not
  fitted: no free parameter of the model was fitted to the published figures below.
- **The crossover band**: the crossover re-predicted with bandwidths x0.8 and x1.25, alphas x0.5 and x2, and
  contention off and doubled, one at a time; the band is the smallest and largest crossover seen.

- **FP8** (`--dtype fp8`: rowwise scales, as vLLM; `fp8-tensorwise`: one scale per tensor, as torchtitan):
  `torch._scaled_mm` times measured on the H200 at the same shard shapes (`data/h200/matmul_fp8_single_gpu.json`;
  rowwise also chunked; tensorwise chunks are tensorwise matmuls of M / tp rows), roofline fitted per dtype for
  other shapes; all_gathers move FP8 bytes, reduce_scatters bf16 outputs; the fused op's own cost is the bf16
  staging line at the FP8 byte count (no FP8 one-rank measurement); activation quantisation is not timed.

Not modelled: embeddings, the LM head (except in the tp 1 check and the AIConfigurator cross-check below),
multi-node traffic, power limits. (NVLink SHARP is in the collected NCCL tables wherever NCCL used it on the
collecting system; the modelled alpha-beta terms leave it out.)

## Against published multi-GPU figures

Error is predicted / published - 1. Targets: speedups within +-15%, crossovers within a factor of 2.

"""

_PAGE_MEASURED = """
## Beside measured rows of the same setup

Where sp_lab has timed a whole model, the prediction is shown next to it. Only single-GPU rows exist so far,
so this checks the compute side (matmuls, attention, norms, LM head), not communication or overlap. With the
collected tables it sets vLLM's kernels, timed by NVIDIA on its H200 system, beside sp_lab's own H200 run.

"""

_PAGE_TAIL = """
## Reading the misses

- The model is built from PyTorch's symmetric-memory fused ops as they run today (torch 2.11, H200). Their
  tp-chunked matmuls re-read the weights once per chunk, which at small token counts costs several times a
  single matmul (measured, [measured-h200.md](measured-h200.md)), and each fused op carries a measured cost of
  its own. Figures from other fused kernels (Triton-distributed, or kernels without per-chunk launches) are
  predicted pessimistically.
- Benchmark method matters most at small token counts. An eager fused call at tp 8 costs ~0.55-0.65 ms of host
  time (the one-rank call plus the op calls of the tp - 1 remote chunks), which is the published fused time of
  vLLM #37489 at M = 1 (548 us); where the model still misses there, the published unfused (baseline) time is
  above the model's device time for it: the benchmark's own per-call overhead, which the model has no
  measurement of. The kraken table times device time (CUDA events, the host queued ahead of the GPU, read from
  its benchmark's source), and there the published fused time (0.61-0.76 ms, flat in M) is well above the
  model's device time for the same op (0.39-0.48 ms): a cost per pipeline step, synchronised across the 8 GPUs,
  that a one-GPU measurement cannot see and that no collected table holds. The term-by-term list under the table
  shows, for each miss, whether the model's value is set by the host floor or by device time. Timed as device
  time (CUDA graphs) the vLLM #37489 ratios at small M stay misses: the chunk matmuls' weight re-reads, measured
  on the H200, cost more than the hidden all_gather at those sizes.
- No term was adjusted to close a miss: a published figure decides nothing in the model.
- Training figures (PyTorch's post, torchtitan) are end-to-end or forward-only training steps with backward,
  recomputation, FSDP and the optimizer; the model predicts one forward decoder layer.
- vLLM's SP thresholds sit where vLLM runs without CUDA graphs (above its largest capture size), so they are
  predicted with eager timing; each call is taken as the larger of its device and host time, pessimistic for a
  whole layer, so the CUDA-graph crossover (given term by term) is the lower end and the eager one the upper end.
  On B200 the matmuls and collectives are collected, but the fused ops' own device cost and overlap are H200
  measurements scaled by datasheet peaks, and the host times are the H200 host's; vLLM's own comment calls the
  SM100 value "a more conservative threshold ... so TP8 starts later".
- With collected tables the crossover band is narrow: the band moves the modelled inputs only (interconnect
  constants, which no longer set any collective, and contention), and the collected tables carry no spread.
"""


_PAGE_CROSS = """
## Beside an independent estimator: AIConfigurator

The baseline (no SP) for a whole Llama 3.1 70B forward beside NVIDIA AIConfigurator's estimate for the same
model, system, tp and token counts (`python -m sp_lab predict --cross-check` prints it; where `aiconfigurator-core`
is installed its estimator runs there, otherwise the values its CLI printed are shown). The two read the same
collected GEMM, all-reduce and attention tables, and agree to the microsecond on those terms (AIConfigurator's own
per-op breakdown); what is left is modelled on both sides and modelled differently: AIConfigurator's norms and
activation cost a few microseconds each (its empirical floor, ~0.5 ms per decode step over 160 norms) where
sp_lab's are memory-bound passes over the step's bytes, which is why sp_lab is lower at decode.

"""


def systems_markdown(model: str = "llama-3-70b", tp: int = 8, tokens: tuple[int, ...] = (256, 2048, 16384)) -> str:
    """Predicted speedup of sp+async_tp and sp over baseline per system (where SP + AsyncTP pays most)."""
    from sp_lab.tuning.predict.hardware import gpu, system_aliases

    lines = [(f"{model}, tp {tp}, bf16, CUDA graphs: baseline latency / variant latency (above 1: the variant is "
             "faster); `tables` says whether the system's collected tables were read."), "",
             "| system | tables | " + " | ".join(f"{t} tokens: sp+async_tp, sp" for t in tokens) + " |",
             "|---|---|" + "---|" * len(tokens)]
    for system in sorted(system_aliases()):
        target = Target.of(gpu(system))
        try:
            rows = predict_layers(model, tp, list(tokens), target, full_layer=True)
        except TablesUnavailable as err:  # e.g. GB200's collected NCCL rows stop at 4 GPUs
            lines.append(f"| {system} | collected | {err} |" + " |" * (len(tokens) - 1))
            continue
        wide = rows.pivot(on="variant", index="num_tokens", values="latency_us").sort("num_tokens")
        cells = [f"{r['baseline'] / r['sp+async_tp']:.2f}x, {r['baseline'] / r['sp']:.2f}x"
                 for r in wide.iter_rows(named=True)]
        lines.append(f"| {system} | {'collected' if target.tables else 'modelled'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def predictions_page(table: pl.DataFrame) -> str:
    """The whole docs/predictions.md: assumptions, the validation table, the cross-check, the measured
    comparison, the systems."""
    from sp_lab.tuning.predict.crosscheck import cross_check_markdown, cross_check_table
    from sp_lab.tuning.predict.measured import tp1_comparison, tp1_markdown

    return (_PAGE_HEAD + validation_markdown(table) + _PAGE_CROSS + cross_check_markdown(cross_check_table())
            + "\n## Where SP + AsyncTP pays, per system\n\n" + systems_markdown()
            + _PAGE_MEASURED + tp1_markdown(tp1_comparison()) + _PAGE_TAIL)
