"""The one regret: how much slower the program a config runs is than the best measured variant.

At a token count ``T`` a :class:`~sp_lab.config.LabConfig` runs one program: ``baseline`` where its
gates leave SP off, ``sp`` where SP runs without AsyncTP, ``sp+async_tp`` where both run (``tuned``
when a per-matmul rule decides fusion: only rows of the tuned config itself time that program).
:func:`regret_table` puts that program's measured latency beside the fastest reference variant's:

    regret_rel(T) = (latency of what the config runs at T - latency of the best variant at T) / best

Every view of a regret (the recommendation, the tuner's plot and table, the HTML report, the CLI and an
exported file's provenance) is computed here, so they cannot disagree.

Rows are pooled per (token count, variant) by the median of their medians. Rows whose expected
fusion did not fire (``fusion_missing``) time another program than their label and are left out, with a
warning. Rows of several sources are never pooled: pass ``source=``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import polars as pl

from sp_lab.programs import REFERENCE_VARIANTS, REWRITE_LEVEL, variant_run

if TYPE_CHECKING:
    from sp_lab.config import LabConfig

REGRET_COLUMNS = ("num_tokens", "variant_run", "latency_us", "best_variant", "best_us", "regret_rel")
"""The columns of :func:`regret_table`, in order."""
REGRET_HEADERS = dict(zip(REGRET_COLUMNS, ("tokens", "config runs", "its latency, us", "fastest variant",
                                           "fastest, us", "regret"), strict=True))
"""How a regret table's columns are headed where people read it (the tuner, the report)."""

_Z95 = 1.959963984540054


def as_frame(rows: pl.DataFrame | Sequence[Mapping]) -> pl.DataFrame:
    """``rows`` as a DataFrame (a list of dicts is accepted), checked for the columns a regret needs."""
    frame = rows if isinstance(rows, pl.DataFrame) else pl.DataFrame(list(rows))
    missing = [c for c in ("num_tokens", "variant", "latency_us") if c not in frame.columns]
    if missing:
        raise ValueError(f"rows lack columns {missing}; need num_tokens, variant, latency_us (+ source)")
    return frame


def one_source(frame: pl.DataFrame, source: str | None = None, *, prefer: Sequence[str] = (),
               option: str = "source=") -> pl.DataFrame:
    """The rows of one source: measured, simulated, rehearsal and replayed rows are never pooled unlabelled.

    The one place that rule is enforced (the regret, the tuner widget, training and the CLI call it). ``source``
    names the source to keep; without it the first of ``prefer`` present is kept (``prefer`` given and none
    present is an error naming what is there), else the rows must come from one source. ``option`` is how the
    caller names the source in the message (the CLI: ``"--source "``).
    """
    if "source" not in frame.columns:
        return frame
    sources = sorted(frame["source"].drop_nulls().unique().to_list())
    if source is None and prefer:
        source = next((s for s in prefer if s in sources), None)
        if source is None:
            raise ValueError(f"no {' or '.join(prefer)} rows (the rows have {sources}); pass "
                             f"{' or '.join(option + s for s in sources)} to use those rows")
    if source is not None:
        if source not in sources:
            raise ValueError(f"no rows with source={source!r}; the rows have {sources}")
        return frame.filter(pl.col("source") == source)
    if len(sources) > 1:
        raise ValueError(
            f"rows mix sources {sources}: measured, predicted, rehearsal and replayed latencies are never "
            f"compared unlabelled; pass source= one of {sources}"
        )
    return frame


def medians(rows: pl.DataFrame | Sequence[Mapping], *, source: str | None = None,
            warn: bool = True) -> pl.DataFrame:
    """``num_tokens, variant, latency_us, se_us, n``: one row per (token count, variant) of one source.

    ``latency_us`` is the median of the rows' medians; ``se_us`` the standard error of that median,
    from the rows' 95% interval (``ci_low_us`` / ``ci_high_us``) or, for rows written before intervals
    were recorded, from their p10-p90 spread and repeats (0 when neither is known).
    """
    frame = one_source(as_frame(rows), source)
    if "fusion_missing" in frame.columns:
        bad = frame.filter(pl.col("fusion_missing").fill_null(False))
        if bad.height and warn:
            warnings.warn(
                f"{bad.height} row(s) whose expected fusion did not fire were left out "
                f"({sorted(set(zip(bad['variant'], bad['num_tokens'], strict=True)))}): they time another "
                "program than their variant", stacklevel=3)
        frame = frame.filter(~pl.col("fusion_missing").fill_null(False))
    cols = set(frame.columns)
    none = pl.lit(None, dtype=pl.Float64)
    from_ci = ((pl.col("ci_high_us") - pl.col("ci_low_us")) / (2 * _Z95)
               if {"ci_low_us", "ci_high_us"} <= cols else none)
    # p10-p90 of a normal spans 2.563 sd; the median's standard error is 1.2533 sd / sqrt(n)
    from_spread = ((pl.col("p90_us") - pl.col("p10_us")) / 2.563 * 1.2533
                   / pl.col("repeats").cast(pl.Float64).sqrt()
                   if {"p10_us", "p90_us", "repeats"} <= cols else none)
    se = pl.coalesce(from_ci.cast(pl.Float64), from_spread.cast(pl.Float64), pl.lit(0.0))
    return (frame.with_columns(se_us=se)
            .group_by("num_tokens", "variant")
            .agg(pl.col("latency_us").median(), pl.col("se_us").median(), n=pl.len())
            .sort("num_tokens", "variant"))


def complete_tokens(pooled: pl.DataFrame) -> list[int]:
    """Token counts where every reference variant present anywhere in ``pooled`` was measured."""
    present = [v for v in REFERENCE_VARIANTS if v in set(pooled["variant"].to_list())]
    if not present:
        return []
    counts = (pooled.filter(pl.col("variant").is_in(present)).group_by("num_tokens")
              .agg(pl.col("variant").n_unique().alias("k")).filter(pl.col("k") == len(present)))
    return sorted(counts["num_tokens"].to_list())


def best_per_token(pooled: pl.DataFrame) -> pl.DataFrame:
    """``num_tokens, best_variant, best_us`` at the complete token counts (ties: the one rewriting less)."""
    tokens = complete_tokens(pooled)
    refs = pooled.filter(pl.col("variant").is_in(list(REFERENCE_VARIANTS)) & pl.col("num_tokens").is_in(tokens))
    return (refs.with_columns(level=pl.col("variant").replace_strict(REWRITE_LEVEL, return_dtype=pl.Int64))
            .sort("num_tokens", "latency_us", "level")
            .group_by("num_tokens", maintain_order=True)
            .agg(best_variant=pl.col("variant").first(), best_us=pl.col("latency_us").first()))


def regret_table(rows: pl.DataFrame | Sequence[Mapping], config: LabConfig, *, source: str | None = None,
                 warn: bool = True) -> pl.DataFrame:
    """Per measured token count: what ``config`` runs there, its latency, the best variant and the regret.

    Columns :data:`REGRET_COLUMNS` (``num_tokens, variant_run, latency_us, best_variant, best_us,
    regret_rel``), sorted by token count. ``rows`` need only ``num_tokens, variant, latency_us`` (and
    ``source`` when they come from several). Token counts where a reference variant or the config's own
    variant is missing (a sweep in progress) are left out; a config whose variant was never measured is an
    error naming it.
    """
    pooled = medians(rows, source=source, warn=warn)
    best = best_per_token(pooled)
    schema = {"num_tokens": pl.Int64, "variant_run": pl.String, "latency_us": pl.Float64,
              "best_variant": pl.String, "best_us": pl.Float64, "regret_rel": pl.Float64}
    if best.height == 0:
        return pl.DataFrame(schema=schema)
    runs = pl.DataFrame({"num_tokens": best["num_tokens"],
                         "variant_run": [variant_run(config, int(t)) for t in best["num_tokens"]]},
                        schema={"num_tokens": pl.Int64, "variant_run": pl.String})
    measured = set(pooled["variant"].to_list())
    never = sorted(set(runs["variant_run"].to_list()) - measured)
    if never:
        raise ValueError(
            f"the config runs {never} at some token counts but no rows of {never} exist; measure them "
            f"(e.g. variants={never}) or pass a config that runs only {sorted(measured)}"
        )
    table = (runs.join(pooled.select("num_tokens", variant_run="variant", latency_us="latency_us"),
                       on=["num_tokens", "variant_run"], how="inner")
             .join(best, on="num_tokens")
             .with_columns(regret_rel=(pl.col("latency_us") - pl.col("best_us")) / pl.col("best_us")))
    return table.select(list(REGRET_COLUMNS)).cast(schema).sort("num_tokens")


def summarize(table: pl.DataFrame) -> tuple[float, float]:
    """(total, worst) relative regret of a :func:`regret_table` (``nan`` for an empty table)."""
    if table.height == 0:
        return math.nan, math.nan
    return float(table["regret_rel"].sum()), float(table["regret_rel"].max())


def traffic_regret(table: pl.DataFrame, weights: Mapping[int, float]) -> float:
    """The regret a traffic feels: ``sum_T w_T * regret_rel(T) / sum_T w_T`` over the table's token counts, where
    ``w_T`` is the share of the traffic's step time at ``T`` (:func:`sp_lab.serving.verdict.count_weights`): a
    config that loses 50% at a size the traffic never runs costs it nothing. ``nan`` when no weight falls on the
    table's counts."""
    w = pl.DataFrame({"num_tokens": list(weights), "w": [float(v) for v in weights.values()]},
                     schema={"num_tokens": pl.Int64, "w": pl.Float64})
    joined = table.select("num_tokens", "regret_rel").join(w, on="num_tokens", how="inner")
    total = float(joined["w"].sum()) if joined.height else 0.0
    return float((joined["w"] * joined["regret_rel"]).sum()) / total if total > 0 else math.nan
