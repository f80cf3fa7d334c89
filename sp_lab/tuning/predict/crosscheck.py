"""The baseline prediction beside an independent estimator's: NVIDIA's AIConfigurator for the same model, system,
tp and token counts (prefill and decode).

AIConfigurator (``aiconfigurator cli estimate ... --backend vllm``) composes a vLLM forward pass from its own
collected per-op tables and models. ``aiconfigurator-core``, the package sp_lab reads its tables from, carries
that estimator (``aiconfigurator_core.sdk.engine.EngineHandle``): where it is installed the estimate is computed
here, otherwise the values recorded from the CLI (:data:`RECORDED`) are shown and labelled so.

sp_lab's side is the whole model as vLLM runs it without SP: every decoder layer (``baseline``), the
vocab-parallel embedding's all_reduce, and the LM head on one row per sequence (vLLM computes logits only for each
sequence's last token). Attention is vLLM's prefill kernel over the sequence, or at decode its decode kernel over
the KV cache, from the collected tables (modelled where there are none).
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass
from functools import cache

import polars as pl

from sp_lab.resources import load_preset
from sp_lab.tuning.microbench import _spec_dims
from sp_lab.tuning.predict import collected
from sp_lab.tuning.predict.kernels import KernelModel, default_table
from sp_lab.tuning.predict.layer import (
    Target,
    baseline_all_reduce,
    num_layers_of,
    plain_mm_us,
    predict_layers,
)
from sp_lab.vocabulary import BASELINE

AIC_MODEL = "meta-llama/Meta-Llama-3.1-70B"
"""The model AIConfigurator estimates (its bundled config; no download)."""
PRESET = "llama-3-70b"
"""sp_lab's preset of the same shapes (Llama 3.1 70B has Llama 3 70B's layers)."""
SYSTEM, TP = "h200_sxm", 8
"""The setup compared."""
TOLERANCE = 0.10
"""Within 10% counts as agreeing."""


@dataclass(frozen=True)
class Case:
    """One estimate: a prefill of ``isl`` tokens (``batch`` sequences) or one decode step of ``batch`` sequences
    with ``isl`` tokens of context each."""

    phase: str
    """``"prefill"`` (AIConfigurator's ``static_ctx``: TTFT) or ``"decode"`` (``static_gen``: TPOT)."""
    isl: int
    """Input sequence length."""
    batch: int
    """Sequences."""


CASES = (Case("prefill", 4096, 1), Case("prefill", 1024, 1), Case("decode", 128, 1), Case("decode", 128, 64))
"""The compared cases (decode at 128 context tokens: the CLI's numbers below were taken there)."""
RECORDED = {CASES[0]: 164.9, CASES[1]: 44.5, CASES[2]: 7.79, CASES[3]: 9.84}
"""AIConfigurator's estimates in ms as its CLI printed them (``aiconfigurator cli estimate --model-path
meta-llama/Meta-Llama-3.1-70B --system h200_sxm --backend vllm --tp-size 8 --estimate-mode static_ctx|static_gen
--isl ... --osl 2 --batch-size ...``), shown where the package is not installed."""


@cache
def _engine():
    from aiconfigurator_core.sdk.engine import EngineHandle

    # its database loader logs every fallback table it reads; none of them is about this model
    quiet = logging.getLogger("aiconfigurator_core")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return EngineHandle.compile(AIC_MODEL, SYSTEM, "vllm", tp_size=TP)
    finally:
        quiet.setLevel(level)


def aic_estimate_ms(case: Case) -> tuple[float, str]:
    """AIConfigurator's estimate for ``case`` and where it came from (computed here, or recorded)."""
    if not collected.available():
        return RECORDED[case], "recorded from the aiconfigurator CLI"
    mode = "static_ctx" if case.phase == "prefill" else "static_gen"
    ctx, gen, _ = _engine().run_static(batch_size=case.batch, isl=case.isl, osl=2, mode=mode)
    return (ctx if case.phase == "prefill" else gen), f"computed by {collected.PACKAGE} {collected.installed_version()}"


def sp_lab_estimate_ms(case: Case, target: Target | None = None) -> dict[str, float]:
    """sp_lab's baseline for ``case``, term by term (ms): ``layers`` (all decoder layers without their attention),
    ``attention`` (prefill: causal over the sequence; decode: each sequence's token over its KV cache),
    ``embedding_ar``, ``lm_head``, and ``total``."""
    target = target or Target.of(SYSTEM)
    dims, preset = _spec_dims(PRESET), load_preset(PRESET)
    hidden, layers = dims["hidden_size"], num_layers_of(PRESET)
    q_heads, kv_heads = dims["num_heads"] // TP, max(1, dims["num_kv_heads"] // TP)
    tokens = case.isl * case.batch if case.phase == "prefill" else case.batch
    rows = predict_layers(PRESET, TP, [tokens], target, num_layers=layers, full_layer=True)
    base = rows.filter(pl.col("variant") == BASELINE).row(0, named=True)
    attention_us = base["attention_us"]
    if case.phase == "decode":
        attention_us = layers * decode_attention_us(target, case, q_heads, kv_heads, dims["head_dim"])
    embedding_us, _, _ = baseline_all_reduce(target, tokens * hidden * 2, TP)
    kernels = KernelModel(default_table(), target.gpu, target.dtype)
    head_us, _ = plain_mm_us(kernels, target, case.batch, int(preset["vocab_size"]) // TP, hidden)
    parts = {"layers": base["latency_us"] - base["attention_us"], "attention": attention_us,
             "embedding_ar": embedding_us, "lm_head": head_us}
    return {**{k: v / 1e3 for k, v in parts.items()}, "total": sum(parts.values()) / 1e3}


def decode_attention_us(target: Target, case: Case, q_heads: int, kv_heads: int, head_dim: int) -> float:
    """One layer's decode attention for ``case`` on one rank: vLLM's decode kernel from the collected table where
    there is one, else modelled (the KV cache's bytes at the datasheet HBM rate, over the prefill table's floor)."""
    table = target.tables.generation_attention if target.tables is not None else None
    if table is not None:
        return table.latency(q_heads, kv_heads, head_dim, case.batch, case.isl).us
    kv_bytes = case.batch * case.isl * 2 * kv_heads * head_dim * 2  # K and V, bf16
    floor = KernelModel(default_table(), target.gpu, target.dtype).attention_us(1, q_heads, head_dim)
    return floor + kv_bytes / (target.gpu.hbm_gbps * 1e3)


def cross_check_table(target: Target | None = None) -> pl.DataFrame:
    """One row per case: ``phase, isl, batch, sp_lab_ms, aic_ms, ratio (sp_lab / aic), within (10%), aic_from,
    sp_lab_tables`` plus sp_lab's terms."""
    target = target or Target.of(SYSTEM)
    out = []
    for case in CASES:
        ours = sp_lab_estimate_ms(case, target)
        aic, source = aic_estimate_ms(case)
        out.append({"phase": case.phase, "isl": case.isl, "batch": case.batch, "sp_lab_ms": ours["total"],
                    "aic_ms": aic, "ratio": ours["total"] / aic, "within": abs(ours["total"] / aic - 1) <= TOLERANCE,
                    "aic_from": source, "sp_lab_tables": "collected" if target.tables is not None else "modelled",
                    **{f"{k}_ms": v for k, v in ours.items() if k != "total"}})
    return pl.DataFrame(out)


def cross_check_markdown(table: pl.DataFrame) -> str:
    """The comparison as a markdown table with its tally."""
    lines = [(f"Llama 3.1 70B, tp {TP}, {SYSTEM}, bf16, vLLM, batch of whole sequences: sp_lab's baseline "
             f"(`{table['sp_lab_tables'][0]}` tables) beside AIConfigurator's estimate "
             f"({table['aic_from'][0]})."), "",
             ("| case | sp_lab ms | AIConfigurator ms | sp_lab / AIC | sp_lab's terms (layers + KV read + embedding "
             "all_reduce + LM head) |"), "|---|---|---|---|---|"]
    for r in table.iter_rows(named=True):
        what = (f"prefill {r['isl']} tokens (TTFT)" if r["phase"] == "prefill"
                else f"decode step, batch {r['batch']}, {r['isl']} context tokens (TPOT)")
        lines.append(f"| {what} | {r['sp_lab_ms']:.2f} | {r['aic_ms']:.2f} | {r['ratio']:.3f} | "
                     f"{r['layers_ms']:.2f} + {r['attention_ms']:.2f} + {r['embedding_ar_ms']:.3f} + "
                     f"{r['lm_head_ms']:.3f} |")
    lines += ["", f"{int(table['within'].sum())} of {table.height} within {100 * TOLERANCE:.0f}% of AIConfigurator."]
    return "\n".join(lines) + "\n"
