"""What a user reads before owning the GPUs: predicted curves per variant, the crossover with its band, and
the config the prediction suggests -- every line labelled ``source: predicted``.

    from sp_lab.tuning.predict.advice import predict
    p = predict("llama-3-70b", tp=8, gpu="h200")
    print(p.text())          # what ``python -m sp_lab predict --model llama-3-70b --tp 8 --gpu h200`` prints
    p.rows                   # sweep-store columns, source="predicted" (the tuner's overlay, the report)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import polars as pl

from sp_lab.programs import REFERENCE_VARIANTS
from sp_lab.resources import preset_names
from sp_lab.tuning.predict.crossover import Crossover, predicted_crossover
from sp_lab.tuning.predict.hardware import BOARD_GPUS
from sp_lab.tuning.predict.layer import PREDICTED_RULE, Target, num_layers_of, predict_layers
from sp_lab.vocabulary import BASELINE, PREDICTED, SP, SP_ASYNC_TP, TUNED

if TYPE_CHECKING:
    from sp_lab.config import LabConfig
    from sp_lab.rules import MatmulRule

DEFAULT_TOKENS = (1, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Token counts the curves are printed at unless told otherwise."""


def check_model(name: str) -> str:
    """``name`` if it is a shipped preset; ``ValueError`` listing the allowed ones otherwise."""
    names = preset_names()
    if name not in names:
        raise ValueError(f"unknown model {name!r} for a prediction; allowed: {', '.join(names)}")
    return name


@dataclass(frozen=True)
class Prediction:
    """Predicted curves, crossovers and the suggested config for one model, tp and GPU."""

    model: str
    """Preset name."""
    tp: int
    """Tensor-parallel size."""
    target: Target
    """GPU, interconnect, dtype, timing."""
    rows: pl.DataFrame
    """Whole-model latency (all decoder layers, attention included) per variant and token count."""
    async_tp: Crossover
    """Where ``sp+async_tp`` starts to beat ``baseline``."""
    sp: Crossover
    """Where ``sp`` starts to beat ``baseline``."""
    rule_name: str = "per-matmul rule the model implies"
    """What decided the ``tuned`` curve: each matmul fused or not."""

    def config(self, base: LabConfig | None = None) -> LabConfig:
        """The config the prediction suggests: baseline below the AsyncTP crossover, SP + AsyncTP from it on
        (SP and AsyncTP off when it never crosses)."""
        import dataclasses

        from sp_lab.config import LabConfig

        base = base or LabConfig(tp_size=self.tp)
        if self.async_tp.tokens is None:
            return dataclasses.replace(base, tp_size=self.tp, enable_sp=False, enable_async_tp=False)
        return dataclasses.replace(base, tp_size=self.tp, enable_sp=True, enable_async_tp=True,
                                   async_tp_min_tokens=self.async_tp.tokens)

    def config_summary(self) -> dict[str, Any]:
        """The suggested config's deciding fields with ``source: predicted`` and the band."""
        c = self.config()
        return {"source": PREDICTED, "model": self.model, "tp": self.tp, "gpu": self.target.gpu.name,
                "dtype": self.target.dtype, "enable_sp": c.enable_sp, "enable_async_tp": c.enable_async_tp,
                "async_tp_min_tokens": c.async_tp_min_tokens if c.enable_async_tp else None,
                "crossover_band": [self.async_tp.low, self.async_tp.high]}

    def text(self) -> str:
        """The labelled report the CLI prints."""
        g, ic = self.target.gpu, self.target.interconnect
        layers = int(self.rows["num_layers"][0])
        wide = self.rows.pivot(on="variant", index="num_tokens", values="latency_us").sort("num_tokens")
        shown = [*REFERENCE_VARIANTS, TUNED]
        head = f"{'tokens':>7} " + " ".join(f"{v:>12}" for v in shown) + "   fastest"
        lines = [
            (f"PREDICTED (source: {PREDICTED}), not measured: {self.model}, tp {self.tp}, {self.tp}x {g.label}, "
            f"{self.target.dtype}, {self.target.timing} timing"),
            (f"  interconnect {ic.label}: " + ("collectives from the collected tables below" if self.target.tables
             else f"busbw {ic.busbw_gbps:.0f} GB/s, alpha {ic.alpha_us:g} us, copies {ic.copy_gbps:.0f} GB/s "
             "(sources in data/hardware.json)")),
            f"  terms: {self.target.provenance()}",
            "",
            f"Predicted latency, {layers} decoder layers (attention and activation included; embeddings and LM head excluded), ms:",
            head,
        ]
        for r in wide.iter_rows(named=True):
            vals = {v: r[v] for v in shown}
            best = min(vals, key=vals.get)
            lines.append(f"{r['num_tokens']:>7} " + " ".join(f"{vals[v] / 1e3:>12.3f}" for v in shown) + f"   {best}")
        lines.append(f"  ({TUNED}: SP with each matmul fused or not by the {self.rule_name})")
        summary = self.config_summary()
        lines += [
            "",
            f"Predicted crossover {SP_ASYNC_TP} over {BASELINE}: {self.async_tp.describe()}",
            f"Predicted crossover {SP} over {BASELINE}: {self.sp.describe()}",
            "  (band: bandwidths x0.8/x1.25, alphas x0.5/x2, contention off/doubled)",
            "",
            "Predicted config (source: predicted): " + ", ".join(f"{k}={v}" for k, v in summary.items()
                                                                if k != "source"),
            "Check it on the GPUs: python -m sp_lab sweep ... then python -m sp_lab tune (measured rows decide).",
        ]
        return "\n".join(lines)


def predict(model: str, tp: int, gpu: str = "h200", *, tokens: Sequence[int] = DEFAULT_TOKENS,
            dtype: str = "bfloat16", timing: str = "graph", rule: MatmulRule | None = None,
            nccl_version: str | None = None, vllm_version: str | None = None,
            collected_tables: bool = True) -> Prediction:
    """Predict ``model`` (a preset) at ``tp`` on 8-GPU boards of ``gpu`` (a system such as ``"h200_sxm"`` or a
    ``hardware.json`` name); ``ValueError`` naming the allowed models / GPUs / dtypes / table versions for a bad
    one. ``rule``: the per-matmul rule of the ``tuned`` curve (default: the one the model implies, fusing each
    matmul where its predicted fused time is smaller). Collected tables are read where installed (newest
    versions unless named); ``collected_tables=False`` predicts from the modelled terms only."""
    if tp > BOARD_GPUS:
        raise ValueError(f"tp={tp}: predictions model one {BOARD_GPUS}-GPU board (its NVLink / NVSwitch); "
                         f"tensor parallelism across nodes is not modelled: pick a tp of at most {BOARD_GPUS}")
    check_model(model)
    target = Target.of(gpu, dtype=dtype, timing=timing, nccl_version=nccl_version, vllm_version=vllm_version,
                       collected_tables=collected_tables)
    rows = predict_layers(model, tp, tokens, target, num_layers=num_layers_of(model), full_layer=True,
                          rule=rule if rule is not None else PREDICTED_RULE)
    name = "per-matmul rule the model implies" if rule is None else f"given rule {rule.uuid()[:8]}"
    return Prediction(model=model, tp=tp, target=target, rows=rows,
                      async_tp=predicted_crossover(model, tp, target),
                      sp=predicted_crossover(model, tp, target, variant=SP), rule_name=name)
