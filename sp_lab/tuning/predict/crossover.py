"""Where a variant starts to beat another in the predictions, with a band from the model's uncertain inputs.

The crossover is the smallest token count on a fine grid from which ``variant`` is faster than ``against``
at every larger count of the grid (``None``: not within the grid). The band re-predicts with each uncertain
input moved one step at a time -- interconnect bandwidths x0.8 and x1.25, fixed costs (alphas) x0.5 and x2,
contention off and doubled -- and reports the smallest and largest crossover seen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import polars as pl

from sp_lab.tuning.model_sp import lasting_crossover
from sp_lab.tuning.predict.layer import Target, predict_layers
from sp_lab.vocabulary import BASELINE, SP_ASYNC_TP

if TYPE_CHECKING:
    from sp_lab.tuning.microbench import ModelDescription
    from sp_lab.tuning.predict.kernels import MatmulTable

GRID = tuple(sorted({round(2 ** (i / 4)) for i in range(4 * 16 + 1)}))
"""Token counts 1 .. 65536, four per doubling."""


@dataclass(frozen=True)
class Crossover:
    """A predicted crossover and its band (token counts; ``None`` = not within the grid)."""

    variant: str
    """The variant that wins from ``tokens`` on."""
    against: str
    """The variant it is compared with."""
    tokens: int | None
    """The nominal model's crossover."""
    low: int | None
    """Smallest crossover over the perturbed inputs."""
    high: int | None
    """Largest crossover over the perturbed inputs (``None`` if some input set never crosses)."""
    grid_max: int
    """Largest token count looked at."""

    def describe(self) -> str:
        """``"4096 tokens (band 2048-8192)"``-style text; "none up to N" where it never crosses."""
        def fmt(x: int | None) -> str:
            return f">{self.grid_max}" if x is None else str(x)
        if self.tokens is None and self.low is None:
            return f"none up to {self.grid_max} tokens"
        return f"{fmt(self.tokens)} tokens (band {fmt(self.low)}-{fmt(self.high)})"


def crossover_tokens(rows: pl.DataFrame, variant: str = SP_ASYNC_TP, against: str = BASELINE) -> int | None:
    """Smallest ``num_tokens`` of ``rows`` from which ``variant``'s latency is below ``against``'s at every
    larger count both were timed at (``None`` if it is not below at the largest). A count only one of the two has
    says nothing about which is faster there, so it is left out rather than read as a loss."""
    wide = rows.filter(pl.col("variant").is_in([variant, against])).pivot(
        on="variant", index="num_tokens", values="latency_us").sort("num_tokens")
    if variant not in wide.columns or against not in wide.columns:
        raise ValueError(f"rows need both {variant!r} and {against!r} rows; have {sorted(rows['variant'].unique())}")
    wide = wide.drop_nulls([variant, against])
    start = lasting_crossover(zip(wide["num_tokens"].to_list(), (wide[variant] < wide[against]).to_list(),
                                  strict=True))
    return None if start is None else int(start)


def perturbed_targets(target: Target) -> list[Target]:
    """``target`` with each uncertain modelled input moved one step: interconnect bandwidths x0.8 / x1.25 and
    alphas x0.5 / x2 (they set the communication only where no collected table does), contention off / doubled."""
    ic = target.interconnect
    bw = [dataclasses.replace(ic, busbw_gbps=ic.busbw_gbps * f, copy_gbps=ic.copy_gbps * f) for f in (0.8, 1.25)]
    alpha = [dataclasses.replace(ic, alpha_us=ic.alpha_us * f, copy_alpha_us=ic.copy_alpha_us * f) for f in (0.5, 2.0)]
    return ([target.replace(interconnect=i) for i in (*bw, *alpha)]
            + [target.replace(contention_scale=s) for s in (0.0, 2.0 * target.contention_scale)])


def predicted_crossover(spec: ModelDescription, tp: int, target: Target | str, *, variant: str = SP_ASYNC_TP,
                        against: str = BASELINE, grid: Sequence[int] = GRID,
                        table: MatmulTable | None = None) -> Crossover:
    """The nominal crossover of ``variant`` over ``against`` and its band (one layer: layers scale both alike)."""
    target = Target.of(target) if isinstance(target, str) else target
    nominal = crossover_tokens(predict_layers(spec, tp, grid, target, num_layers=1, table=table), variant, against)
    seen = [crossover_tokens(predict_layers(spec, tp, grid, t, num_layers=1, table=table), variant, against)
            for t in perturbed_targets(target)]
    seen.append(nominal)
    crossing = [x for x in seen if x is not None]
    low = min(crossing) if crossing else None
    high = None if None in seen else max(crossing)
    return Crossover(variant=variant, against=against, tokens=nominal, low=low, high=high, grid_max=max(grid))
