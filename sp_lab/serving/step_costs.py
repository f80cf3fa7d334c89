"""What a step costs under each variant, from latency rows of one source.

Rows come from one of two places and are never mixed: **measured** rows of the user's setup from the sweep store
(:func:`measured_rows`, pooled per token count and variant with the standard error of each median from the rows'
own 95% intervals) or, where none exist, **predicted** rows of the performance model (:func:`predicted_rows`,
the one adapter to :mod:`sp_lab.tuning.predict`). :class:`LatencyCurves` holds one curve per variant and prices a
step of any token count inside the rows: at a row's count its latency, between two rows linear interpolation in
the token count (said in the report with the share of steps it priced); a count below the smallest or above the
largest row is refused, naming the count and what to measure.

The rows time the decoder layers (attention over the step's own tokens included, embeddings and LM head not).
:class:`SharedTerms` adds what every policy pays alike and the rows leave out: the decodes' reads of their KV
cache and the LM head's weight read, both from the HBM roofline of the GPU. They lower every ratio towards 1 (a
saving on the layers is a smaller share of the step) and are labelled ``modelled`` wherever they are used.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from sp_lab.serving.scheduler import StepPrice
from sp_lab.vocabulary import MEASURED, TUNED

if TYPE_CHECKING:
    from sp_lab.bench.setups import SetupChoice
    from sp_lab.config import LabConfig

__all__ = ["Curve", "LatencyCurves", "SharedTerms", "measured_rows", "predicted_curves", "predicted_rows",
           "predicted_token_grid", "shared_terms"]


def predicted_token_grid(max_tokens: int) -> list[int]:
    """Token counts predicted rows are computed at: every count to 64 (where decode batches live and padding to
    ``tp`` makes steps), then eight per doubling up to ``max_tokens``."""
    fine = list(range(1, min(64, max_tokens) + 1))
    coarse, t = [], 64.0
    while t < max_tokens:
        t *= 2 ** (1 / 8)
        coarse.append(min(max_tokens, round(t)))
    return sorted(set(fine + coarse))


@functools.lru_cache(maxsize=8)
def predicted_rows(model: str, tp: int, gpu: str, dtype: str = "bfloat16", max_tokens: int = 8192) -> pl.DataFrame:
    """Predicted rows (``num_tokens, variant, latency_us``, ``source="predicted"`` and the model's provenance
    columns) for ``model`` at ``tp`` on ``gpu``, at :func:`predicted_token_grid` counts.

    The one place this package calls the performance model: the rows ``python -m sp_lab predict`` prints
    (``advice.predict``'s own call: all layers, attention included, ``tuned`` by the rule the model implies),
    without the crossovers that command also computes (they re-predict a fine grid seven times over). The same
    numbers as :func:`sp_lab.tuning.predict.steps.step_latency_rows` (tested), which has no ``tuned`` curve and
    re-predicts every count under seven perturbed inputs for its band.
    """
    from sp_lab.tuning.predict.advice import check_model
    from sp_lab.tuning.predict.hardware import BOARD_GPUS
    from sp_lab.tuning.predict.layer import PREDICTED_RULE, Target, num_layers_of, predict_layers

    check_model(model)
    if tp > BOARD_GPUS:
        raise ValueError(f"tp={tp}: predictions model one {BOARD_GPUS}-GPU board; pick a tp of at most {BOARD_GPUS} "
                         "or give measured rows (--store)")
    return predict_layers(model, tp, predicted_token_grid(max_tokens), Target.of(gpu, dtype=dtype),
                          num_layers=num_layers_of(model), full_layer=True, rule=PREDICTED_RULE)


def measured_rows(store: str | Path, model: str, tp: int, *, dtype: str | None = None,
                  device_name: str | None = None, config: LabConfig | None = None) -> pl.DataFrame:
    """Measured rows of one setup from the sweep store at ``store`` (:func:`measured_setup`'s rows)."""
    return measured_setup(store, model, tp, dtype=dtype, device_name=device_name, config=config)[0]


def measured_setup(store: str | Path, model: str, tp: int, *, dtype: str | None = None,
                   device_name: str | None = None, config: LabConfig | None = None
                   ) -> tuple[pl.DataFrame, SetupChoice]:
    """Measured rows of one setup from the sweep store at ``store``, and which setup
    (:func:`sp_lab.bench.setups.select_setup`: the newest with this model and tp, and ``dtype`` / ``device_name``
    when given; its message lists the others); ``ValueError`` naming what is there when nothing matches.

    ``tuned`` rows time one config each: with ``config`` only that config's (its ``config_hash``) are kept;
    without, they are kept when they all come from one config and left out, with a warning, when they do not.
    """
    from sp_lab.bench.setups import select_setup
    from sp_lab.bench.store import SweepStore

    frame = SweepStore(Path(store)).read(skip_corrupt=True)
    if frame.height == 0:
        raise ValueError(f"the store {store} holds no rows; sweep first (python -m sp_lab sweep ...) or leave out "
                         "--store to use predicted rows")
    measured = frame.filter(pl.col("source") == MEASURED)
    if measured.height == 0:
        raise ValueError(f"the store {store} holds no measured rows (only {sorted(set(frame['source']))}); sweep "
                         "first or leave out --store to use predicted rows")
    asked = {k: v for k, v in {"model": model, "tp": tp, "dtype": dtype, "device_name": device_name}.items()
             if v is not None}
    rows, choice = select_setup(measured, asked, style="cli")  # SetupNotFoundError (a ValueError) lists them
    tuned = pl.col("variant") == TUNED
    hashes = sorted(set(rows.filter(tuned)["config_hash"].to_list()))
    if config is not None:
        from sp_lab.bench.sweep import config_hash

        rows = rows.filter(~tuned | (pl.col("config_hash") == config_hash(config)))
    elif len(hashes) > 1:
        warnings.warn(f"tuned rows of {len(hashes)} configs ({', '.join(hashes)}) are left out: pass the tuned "
                      "config (--config FILE) to price its own rows", stacklevel=2)
        rows = rows.filter(~tuned)
    return rows, choice


@dataclass(frozen=True)
class Curve:
    """One variant's latency (and its standard error) at the rows' token counts, ascending."""

    variant: str
    tokens: np.ndarray
    """Token counts with a row (int, ascending, unique)."""
    latency_us: np.ndarray
    """Latency at each count (median of the rows' medians)."""
    se_us: np.ndarray
    """Standard error of each latency (0 where the rows carry no interval, as predicted rows)."""

    def weights(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each count: ``(index of the row below, index above, weight of the row below)``; at a row's own
        count both indices are that row and the weight 1. Linear interpolation in the token count."""
        hi = np.searchsorted(self.tokens, counts, side="left")
        exact = (hi < self.tokens.size) & (self.tokens[np.minimum(hi, self.tokens.size - 1)] == counts)
        lo = np.where(exact, hi, hi - 1)
        hi = np.minimum(hi, self.tokens.size - 1)
        span = (self.tokens[hi] - self.tokens[lo]).astype(float)
        w_lo = np.where(exact | (span == 0), 1.0, (self.tokens[hi] - counts) / np.where(span == 0, 1, span))
        return lo, hi, w_lo

    def at(self, counts: Sequence[int] | np.ndarray) -> np.ndarray:
        """Latency at each count (inside the rows; see :meth:`LatencyCurves.check_counts`)."""
        counts = np.asarray(counts)
        lo, hi, w = self.weights(counts)
        return w * self.latency_us[lo] + (1 - w) * self.latency_us[hi]


@dataclass(frozen=True)
class SharedTerms:
    """Per-step time every policy pays alike and the rows leave out (modelled from the HBM roofline)."""

    kv_us_per_token: float = 0.0
    """Reading one context token's K and V in every layer, on one GPU (decodes only)."""
    per_step_us: float = 0.0
    """The LM head's weight read, once per step."""
    description: str = "none"
    """What is modelled, for the report."""


def shared_terms(model: str, tp: int, gpu: str) -> SharedTerms:
    """:class:`SharedTerms` for a preset at ``tp`` on ``gpu`` (bf16 KV cache and LM head weights); none for a
    model that is not a preset (its shapes are unknown here), said in the description."""
    from sp_lab.resources import load_preset, preset_names
    from sp_lab.tuning.predict.hardware import gpu as gpu_spec

    if model not in preset_names():
        return SharedTerms(description=f"none: {model!r} is not a preset, so its KV-cache and LM-head reads are "
                                       "not modelled (the ratio is of the decoder layers alone)")
    p = load_preset(model)
    g = gpu_spec(gpu)
    head_dim = int(p.get("head_dim") or p["hidden_size"] // p["num_attention_heads"])
    kv_heads = max(1, int(p.get("num_key_value_heads") or p["num_attention_heads"]) // tp)  # replicated below tp
    kv_bytes = 2 * int(p["num_hidden_layers"]) * kv_heads * head_dim * 2  # K and V, bf16
    head_bytes = int(p["vocab_size"]) * int(p["hidden_size"]) * 2 / tp
    bytes_per_us = g.hbm_gbps * 1e3  # GB/s -> bytes per microsecond
    return SharedTerms(kv_us_per_token=kv_bytes / bytes_per_us, per_step_us=head_bytes / bytes_per_us,
                       description=(f"modelled, the same in every policy: KV-cache reads of the decodes ({kv_bytes} B "
                                    f"per context token per GPU) and the LM head's weights ({head_bytes / 1e6:.0f} MB "
                                    f"per step per GPU) at {g.label}'s {g.hbm_gbps:.0f} GB/s"))


@dataclass(frozen=True)
class LatencyCurves:
    """Latency per variant from rows of one source, and their provenance."""

    curves: Mapping[str, Curve]
    """One per variant present."""
    source: str
    """``measured``, ``predicted``, ``replayed`` ...: the rows' one source."""
    provenance: str
    """Model, tp, device, dtype, timing and where the rows come from, in one line."""
    shared: SharedTerms = SharedTerms()
    """Terms added to every step (see the module docstring)."""

    @classmethod
    def from_rows(cls, rows: pl.DataFrame, *, shared: SharedTerms | None = None) -> LatencyCurves:
        """Curves from store-like rows (``num_tokens, variant, latency_us``, ``source``, optional intervals);
        rows of several sources are refused (:func:`sp_lab.tuning.regret.one_source`)."""
        from sp_lab.tuning.regret import medians, one_source

        rows = one_source(rows)
        source = str(rows["source"][0]) if "source" in rows.columns else MEASURED
        pooled = medians(rows, warn=False)
        curves = {}
        for (variant,), part in pooled.sort("num_tokens").group_by("variant", maintain_order=True):
            curves[str(variant)] = Curve(str(variant), part["num_tokens"].to_numpy().astype(np.int64),
                                         part["latency_us"].to_numpy().astype(float),
                                         part["se_us"].to_numpy().astype(float))
        first = rows.row(0, named=True)
        where = [f"{k} {first[k]}" for k in ("model", "tp", "dtype", "device_name", "timing_method") if k in first]
        if source != MEASURED and first.get("note"):  # a model's rows say what they were computed from
            where.append(str(first["note"]))
        return cls(curves=curves, source=source, provenance=f"{source} rows: " + ", ".join(where),
                   shared=shared or SharedTerms())

    def curve(self, variant: str) -> Curve:
        """The variant's curve; ``ValueError`` naming the variants the rows have."""
        if variant not in self.curves:
            raise ValueError(f"no {self.source} rows of variant {variant!r}; the rows have {sorted(self.curves)}")
        return self.curves[variant]

    def coverage(self, variant: str) -> tuple[int, int]:
        """Smallest and largest token count with a row of ``variant``."""
        t = self.curve(variant).tokens
        return int(t[0]), int(t[-1])

    def check_counts(self, variant: str, counts: Sequence[int] | np.ndarray) -> None:
        """``ValueError`` if a count lies outside ``variant``'s rows: no step is priced by extrapolation."""
        counts = np.asarray(counts)
        lo, hi = self.coverage(variant)
        outside = counts[(counts < lo) | (counts > hi)]
        if outside.size:
            raise ValueError(
                f"steps of {sorted(set(outside.tolist()))[:5]} tokens lie outside the {self.source} rows of "
                f"{variant!r} ({lo}..{hi} tokens): measure those counts (python -m sp_lab sweep --tokens ...) or, "
                f"for a schedule, lower max_num_batched_tokens to {hi}; sp_lab does not extrapolate")

    def price(self, variant_at: Sequence[str], max_tokens: int, *, counts: Sequence[int] | None = None) -> StepPrice:
        """The :class:`StepPrice` of a program that runs ``variant_at[T]`` at ``T`` tokens (index 0 unused), with
        the shared terms added: every count ``1..max_tokens`` (what a schedule may reach), or only ``counts``
        (a recorded step list; the others stay NaN)."""
        table = np.full(max_tokens + 1, np.nan)
        wanted = np.arange(1, max_tokens + 1) if counts is None else np.unique(np.asarray(counts, dtype=np.int64))
        names = np.asarray(variant_at)[wanted]
        for variant in np.unique(names):
            sel = wanted[names == variant]
            self.check_counts(str(variant), sel)
            table[sel] = self.curve(str(variant)).at(sel)
        table[wanted] += self.shared.per_step_us
        return StepPrice(tuple(table.tolist()), self.shared.kv_us_per_token)

    def interpolated(self, variant: str, counts: np.ndarray) -> np.ndarray:
        """Which of ``counts`` fall between two rows of ``variant`` (priced by interpolation)."""
        return ~np.isin(counts, self.curve(variant).tokens)



def predicted_curves(model: str, tp: int, gpu: str, *, dtype: str = "bfloat16", max_tokens: int = 8192
                     ) -> LatencyCurves:
    """:class:`LatencyCurves` of :func:`predicted_rows` with the modelled :func:`shared_terms` added."""
    return LatencyCurves.from_rows(predicted_rows(model, tp, gpu, dtype, max_tokens=max_tokens),
                                   shared=shared_terms(model, tp, gpu))
