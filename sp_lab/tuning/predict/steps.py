"""Predicted step latency per token count and variant, with a band and per-term provenance: the rows other
parts of sp_lab consume (the serving simulation among them).

    from sp_lab.tuning.predict.steps import step_latency_rows
    rows = step_latency_rows("llama-3-70b", 8, "h200_sxm", "bfloat16", [1, 64, 512, 4096])

One row per (token count, variant) for ``baseline``, ``sp`` and ``sp+async_tp``; the same model as
``python -m sp_lab predict`` (:func:`~sp_lab.tuning.predict.layer.predict_layers`, whole decoder layers with
attention), so the two never disagree.
"""

from __future__ import annotations

from collections.abc import Iterable

import polars as pl

from sp_lab.programs import REFERENCE_VARIANTS
from sp_lab.tuning.predict.crossover import perturbed_targets
from sp_lab.tuning.predict.layer import Target, num_layers_of, predict_layers

STEP_COLUMNS = ("num_tokens", "variant", "latency_us", "latency_low_us", "latency_high_us", "source", "tables",
                "provenance", "all_reduce_impl", "outside_grid", "model", "tp", "gpu", "system", "dtype",
                "num_layers", "timing_method", "covers")
"""The columns of :func:`step_latency_rows`, in order (a stable interface)."""
COVERS = ("all decoder layers (matmuls, collectives, norms, activation, causal attention over one sequence of "
          "num_tokens tokens); embeddings, LM head, sampling and the scheduler excluded")
"""What a step's predicted latency includes."""


def step_latency_rows(model: str, tp: int, gpu: str, dtype: str, token_counts: Iterable[int], *,
                      timing: str = "graph", nccl_version: str | None = None, vllm_version: str | None = None,
                      collected_tables: bool = True) -> pl.DataFrame:
    """Predicted latency of one forward step of ``model`` (a preset) at each token count, per variant.

    Args:
        model: preset name (``"llama-3-70b"``).
        tp: tensor-parallel size (one 8-GPU board).
        gpu: a system with collected tables (``"h200_sxm"``, ``"l40s"``, ...) or a ``hardware.json`` GPU
            (``"h200"`` aliases ``"h200_sxm"``).
        dtype: ``"bfloat16"``, ``"fp8"`` (rowwise scales) or ``"fp8-tensorwise"``.
        token_counts: tokens per step (each >= 1).
        timing: ``"graph"`` (CUDA-graph replay, as vLLM serves) or ``"eager"``.
        nccl_version, vllm_version: which collected tables (default: the newest).
        collected_tables: ``False`` predicts from the modelled terms only.

    Returns:
        :data:`STEP_COLUMNS`: ``latency_us`` is the nominal prediction; ``latency_low_us`` / ``latency_high_us``
        the smallest and largest over the modelled inputs moved one step each
        (:func:`~sp_lab.tuning.predict.crossover.perturbed_targets`; collected terms carry no spread, so on a
        system with tables the baseline's and sp's bands are their nominal value); ``tables`` is ``"collected"`` or
        ``"modelled"`` and ``provenance`` says which term came from where; ``outside_grid`` names any table
        lookup extrapolated beyond its collected grid; ``source`` is always ``"predicted"``.
    """
    target = Target.of(gpu, dtype=dtype, timing=timing, nccl_version=nccl_version, vllm_version=vllm_version,
                       collected_tables=collected_tables)
    layers = num_layers_of(model)
    tokens = sorted({int(t) for t in token_counts})

    def run(t: Target) -> pl.DataFrame:
        return predict_layers(model, tp, tokens, t, num_layers=layers, full_layer=True).filter(
            pl.col("variant").is_in(list(REFERENCE_VARIANTS)))

    nominal = run(target)
    spread = pl.concat([run(t).select("num_tokens", "variant", "latency_us") for t in perturbed_targets(target)])
    band = spread.group_by("num_tokens", "variant").agg(latency_low_us=pl.col("latency_us").min(),
                                                        latency_high_us=pl.col("latency_us").max())
    out = nominal.join(band, on=["num_tokens", "variant"]).with_columns(
        latency_low_us=pl.min_horizontal("latency_low_us", "latency_us"),
        latency_high_us=pl.max_horizontal("latency_high_us", "latency_us"),
        covers=pl.lit(COVERS))
    order = {v: i for i, v in enumerate(REFERENCE_VARIANTS)}
    return out.sort(["num_tokens", pl.col("variant").replace_strict(order)]).select(STEP_COLUMNS)
