"""The token threshold ``async_tp_min_tokens``: its gated curve, its regret, and the recommended value.

A sweep measures each variant at each token count. ``LabConfig.async_tp_min_tokens`` gates whole
compile ranges: below it the model runs the ``baseline`` program, at or above it ``sp+async_tp``.
For a candidate threshold the **gated curve** is that piecewise choice, and its **regret** at a
token count is how much slower it is than the better of the two there. The recommended threshold
minimises the total relative regret over the measured token counts (ties: the smaller worst-case
regret, then the smaller threshold).

Rows whose fusion was expected but did not fire (``fusion_missing``) time a different program from
the one their label names, so they are dropped from ``sp+async_tp`` with a warning. Measured and
simulated rows are never mixed: pass ``source=`` to pick one when a frame holds both.

vLLM's own rule (bytes per GPU, docs/thresholds.md) is available as a reference line via
:func:`vllm_reference_threshold`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import polars as pl

BELOW, ABOVE = "baseline", "sp+async_tp"
"""The variants the gate chooses between: below the threshold, and at or above it."""


def _select(df: pl.DataFrame, source: str | None) -> pl.DataFrame:
    """One source's rows, medians per (num_tokens, variant), fusion-missing fused rows removed."""
    missing = [c for c in ("num_tokens", "variant", "latency_us") if c not in df.columns]
    if missing:
        raise ValueError(f"sweep rows lack columns {missing}; need num_tokens, variant, latency_us (+ source)")
    if "source" in df.columns:
        sources = sorted(df["source"].unique().to_list())
        if source is not None:
            if source not in sources:
                raise ValueError(f"no rows with source={source!r}; the frame has {sources}")
            df = df.filter(pl.col("source") == source)
        elif len(sources) > 1:
            raise ValueError(
                f"rows mix sources {sources}: measured and simulated latencies are never compared unlabelled; "
                f"pass source= one of {sources}"
            )
    if "fusion_missing" in df.columns:
        dropped = df.filter((pl.col("variant") == ABOVE) & pl.col("fusion_missing").fill_null(False))
        if dropped.height:
            warnings.warn(
                f"{dropped.height} {ABOVE} rows where fusion did not fire were excluded (num_tokens "
                f"{sorted(set(dropped['num_tokens'].to_list()))}): they time the unfused program",
                stacklevel=3,
            )
            df = df.filter(~((pl.col("variant") == ABOVE) & pl.col("fusion_missing").fill_null(False)))
    return df.group_by("num_tokens", "variant").agg(pl.col("latency_us").median())


def _wide(df: pl.DataFrame, source: str | None) -> pl.DataFrame:
    """``num_tokens, baseline, sp+async_tp`` at token counts where both exist."""
    med = _select(df, source)
    for v in (BELOW, ABOVE):
        if med.filter(pl.col("variant") == v).height == 0:
            raise ValueError(f"no {v!r} rows; the gate needs both {BELOW!r} and {ABOVE!r} measured")
    wide = med.filter(pl.col("variant").is_in([BELOW, ABOVE])).pivot(
        on="variant", index="num_tokens", values="latency_us").sort("num_tokens")
    incomplete = wide.filter(pl.col(BELOW).is_null() | pl.col(ABOVE).is_null())
    if incomplete.height:
        warnings.warn(f"token counts {incomplete['num_tokens'].to_list()} lack one of {BELOW}/{ABOVE}; skipped",
                      stacklevel=3)
        wide = wide.drop_nulls([BELOW, ABOVE])
    return wide


def gated_curve(df: pl.DataFrame, threshold: int, *, source: str | None = None) -> pl.DataFrame:
    """``num_tokens, latency_us, variant``: ``baseline`` below ``threshold``, ``sp+async_tp`` at/above."""
    wide = _wide(df, source)
    above = pl.col("num_tokens") >= threshold
    return wide.select(
        "num_tokens",
        latency_us=pl.when(above).then(pl.col(ABOVE)).otherwise(pl.col(BELOW)),
        variant=pl.when(above).then(pl.lit(ABOVE)).otherwise(pl.lit(BELOW)),
    )


def regret_table(df: pl.DataFrame, threshold: int, *, source: str | None = None) -> pl.DataFrame:
    """Per token count: ``gated_us, best_us, best_variant, regret_us, regret_rel`` for ``threshold``.

    ``best`` is the faster of ``baseline`` and ``sp+async_tp`` there; ``regret_rel = regret_us / best_us``.
    """
    wide = _wide(df, source)
    above = pl.col("num_tokens") >= threshold
    return wide.select(
        "num_tokens",
        gated_us=pl.when(above).then(pl.col(ABOVE)).otherwise(pl.col(BELOW)),
        best_us=pl.min_horizontal(BELOW, ABOVE),
        best_variant=pl.when(pl.col(ABOVE) < pl.col(BELOW)).then(pl.lit(ABOVE)).otherwise(pl.lit(BELOW)),
    ).with_columns(regret_us=pl.col("gated_us") - pl.col("best_us")).with_columns(
        regret_rel=pl.col("regret_us") / pl.col("best_us"))


@dataclass
class Recommendation:
    """The threshold with the least regret over the measured token counts."""

    threshold: int
    """Recommended ``async_tp_min_tokens``; one past the largest token count means "never fuse"."""
    total_regret: float
    """Sum over token counts of the relative regret (``regret_us / best_us``) at this threshold."""
    max_rel_regret: float
    """Worst relative regret at any token count at this threshold."""
    never_fuse: bool
    """True when no measured token count gains from ``sp+async_tp`` enough to enable it."""
    candidates: pl.DataFrame = field(repr=False)
    """Every candidate: ``threshold, total_regret, max_rel_regret, total_regret_us``."""

    def summary(self) -> str:
        """One readable line."""
        what = "never enable AsyncTP (no measured gain)" if self.never_fuse else f"async_tp_min_tokens={self.threshold}"
        return (f"{what}: total relative regret {self.total_regret:.4f}, worst {100 * self.max_rel_regret:.2f}% "
                f"({self.candidates.height} candidates)")


def recommend_threshold(df: pl.DataFrame, *, source: str | None = None) -> Recommendation:
    """Choose ``async_tp_min_tokens`` among the measured token counts (and "never") by least regret."""
    wide = _wide(df, source)
    tokens = wide["num_tokens"].to_list()
    rows = []
    for thr in [*tokens, tokens[-1] + 1]:
        reg = regret_table(wide.unpivot(index="num_tokens", variable_name="variant", value_name="latency_us"), thr)
        rows.append({"threshold": thr, "total_regret": float(reg["regret_rel"].sum()),
                     "max_rel_regret": float(reg["regret_rel"].max()), "total_regret_us": float(reg["regret_us"].sum())})
    cand = pl.DataFrame(rows)
    best = cand.sort("total_regret", "max_rel_regret", "threshold").row(0, named=True)
    return Recommendation(threshold=int(best["threshold"]), total_regret=best["total_regret"],
                          max_rel_regret=best["max_rel_regret"], never_fuse=best["threshold"] > tokens[-1],
                          candidates=cand)


def vllm_reference_threshold(hidden: int, dtype_bytes: int, tp: int,
                             capability: tuple[int, int] = (9, 0)) -> int | None:
    """vLLM's bytes-per-GPU SP threshold (``sp_min_token_num``), drawn as a reference line.

    Delegates to :func:`sp_lab.config.vllm_sp_min_token_num`; ``None`` where vLLM leaves SP off.
    """
    from sp_lab.config import vllm_sp_min_token_num  # layer 1; imported here to keep this module light

    return vllm_sp_min_token_num(hidden, dtype_bytes, tp, capability)
