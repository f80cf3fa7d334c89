"""The model beside measured rows of the same setup: where sp_lab has timed a whole model, the prediction
error per token count (:func:`compare_to_measured` for any sweep rows; :func:`tp1_comparison` for the shipped
tp 1 H200 rows).

The only such rows today are single-GPU (``data/h200/tp1_latency.json``: a 4-layer Llama-3-8B at
tp 1 on the H200, compiled with full-and-piecewise CUDA graphs). At tp 1 every variant is the same program,
so this checks the compute side of the model -- matmuls and attention (vLLM's kernels from the collected H200
tables where aiconfigurator-core is installed, else sp_lab's H200 tables with roofline estimates for these tp 1
shapes), norms and activation -- plus the LM head, not the communication or overlap side (no multi-GPU rows
exist yet).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import polars as pl

from sp_lab.resources import h200_file, load_preset
from sp_lab.tuning.predict.kernels import KernelModel, default_table
from sp_lab.tuning.predict.layer import Target, plain_mm_us, predict_layers
from sp_lab.vocabulary import BASELINE, MEASURED, PREDICTED

TP1_JSON = h200_file("tp1_latency.json")
"""4-layer Llama-3-8B, tp 1, bf16, on one H200 (several compile modes)."""
TP1_VARIANT = "sp_lab full_and_piecewise"
"""The measured mode compared: sp_lab's own CUDA-graph mode, device-bound like the model."""


def tp1_comparison() -> pl.DataFrame:
    """``num_tokens, measured_ms, predicted_ms, error`` (predicted / measured - 1) for the tp 1 rows, with
    ``model, num_layers, device_name, measured_variant``."""
    data = json.loads(TP1_JSON.read_text())
    what = data["meta"]["what"]  # "llama-3-8b shape, 4 layers, ..."
    model, layers = "llama-3-8b", int(what.split(",")[1].split()[0])
    rows = [r for r in data["rows"] if r["variant"] == TP1_VARIANT]
    tokens = [int(r["num_tokens"]) for r in rows]
    target = Target.of("h200")
    layer = predict_layers(model, 1, tokens, target, num_layers=layers, full_layer=True).filter(
        pl.col("variant") == BASELINE)
    preset = load_preset(model)
    kernels = KernelModel(default_table(), target.gpu)
    hidden, vocab = int(preset["hidden_size"]), int(preset["vocab_size"])
    # the LM head is a [T, H] @ [H, vocab] matmul (logits for every token), plus the final norm
    head = {t: plain_mm_us(kernels, target, t, vocab, hidden)[0] + kernels.elementwise_us(2 * t * hidden * 2)
            for t in tokens}
    predicted = {r["num_tokens"]: (r["latency_us"] + head[r["num_tokens"]]) / 1e3 for r in layer.iter_rows(named=True)}
    out = pl.DataFrame({"num_tokens": tokens, "measured_ms": [float(r["ms"]) for r in rows],
                        "predicted_ms": [predicted[t] for t in tokens]})
    return out.with_columns(error=pl.col("predicted_ms") / pl.col("measured_ms") - 1.0, model=pl.lit(model),
                            num_layers=pl.lit(layers), device_name=pl.lit(data["meta"]["device"]),
                            tables=pl.lit("collected" if target.tables is not None else "modelled"),
                            measured_variant=pl.lit(TP1_VARIANT)).sort("num_tokens")


def tp1_markdown(table: pl.DataFrame) -> str:
    """The comparison as a markdown table."""
    r0 = table.row(0, named=True)
    lines = [(f"{r0['model']}, {r0['num_layers']} layers, tp 1, bf16, {r0['device_name']}: measured "
             f"(`{r0['measured_variant']}`, `data/h200/tp1_latency.json`) vs predicted (attention, "
             f"activation, norms and LM head included; {r0['tables']} matmul and attention tables)"), "",
             "| tokens | measured ms | predicted ms | error |", "|---|---|---|---|"]
    lines += [f"| {r['num_tokens']} | {r['measured_ms']:.3f} | {r['predicted_ms']:.3f} | {100 * r['error']:+.0f}% |"
              for r in table.iter_rows(named=True)]
    return "\n".join(lines) + "\n"


def compare_to_measured(predicted: pl.DataFrame, measured: pl.DataFrame,
                        on: Sequence[str] = ("num_tokens", "variant", "tp")) -> pl.DataFrame:
    """Prediction error per point where both exist: ``predicted_us, measured_us, error_us, rel_error``.

    ``predicted`` must hold only ``source="predicted"`` rows and ``measured`` only ``"measured"`` ones;
    measured rows whose fusion was expected but missing are dropped (they time another program).
    """
    for df, wants, label in ((predicted, PREDICTED, "predicted"), (measured, MEASURED, "measured")):
        got = set(df["source"].unique()) if "source" in df.columns else {None}
        if got != {wants}:
            raise ValueError(f"{label} rows must all have source={wants!r}; got {sorted(map(str, got))}")
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
