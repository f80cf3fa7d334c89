"""Which program to run at which token count: policies, their regret, and a recommendation that knows its noise.

A **policy** runs a reference variant per token range, rewriting more as token counts grow:
``baseline`` -> ``sp`` -> ``sp+async_tp`` (a policy never goes back). What :class:`~sp_lab.config.LabConfig`
can express, and so what :func:`recommend` searches:

- one program everywhere (``baseline``: SP and AsyncTP never; ``sp``; ``sp+async_tp``);
- one threshold: ``baseline`` / ``sp`` below it, ``sp`` / ``sp+async_tp`` from it on (any of the three pairs);
- two thresholds: ``baseline``, then ``sp``, then ``sp+async_tp``. LabConfig can run these
  (``sp_min_tokens``), vLLM cannot (one gate for SP and AsyncTP), so they are only reported: how much a
  second threshold would gain over the recommended one-threshold policy, and whether that is beyond noise.

**Noise.** Every median comes with a standard error (from its 95% interval, see
:func:`sp_lab.tuning.regret.medians`). The recommendation draws ``n_boot`` resamples of the latency table
from those errors (log-normal, seeded: the same rows give the same answer), scores every policy on each, and calls a
policy *not distinguishable* from the best one when it is at least as good in at least ``alpha`` of the
resamples. Among the policies the data cannot tell apart it picks the one that rewrites least (fewest
token counts moved to a more rewriting program, summed over rewrite levels), because a rewrite that
buys nothing measurable is a risk with no return. Thresholds are measured token counts: between two
measured counts the data say nothing.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from sp_lab.programs import REFERENCE_VARIANTS, Policy
from sp_lab.tuning.regret import as_frame, complete_tokens, medians, regret_table, summarize
from sp_lab.vocabulary import BASELINE, NEVER, SP, SP_ASYNC_TP, describe_threshold

if TYPE_CHECKING:
    from sp_lab.config import LabConfig


def fusion_threshold(config: LabConfig) -> int | None:
    """The token count from which ``config`` fuses (its ``async_tp_min_tokens``), or ``None`` where it never does
    (SP off, or SP without AsyncTP). What ``tune``, ``tune --json`` and an exported file all report."""
    return config.async_tp_min_tokens if config.enable_sp and config.enable_async_tp else None


def threshold_text(config: LabConfig) -> str:
    """:func:`fusion_threshold` as a person reads it: the number, or "never"."""
    return describe_threshold(fusion_threshold(config))


def candidate_policies(tokens: Sequence[int], variants: Sequence[str], *,
                       thresholds: int = 1) -> list[Policy]:
    """Every policy over ``variants`` switching at measured ``tokens`` with at most ``thresholds`` switches."""
    ordered = [v for v in REFERENCE_VARIANTS if v in variants]
    switch_at = sorted(set(tokens))[1:]  # a switch at the smallest count is the constant policy
    out = [Policy.constant(v) for v in ordered]
    for k in range(1, thresholds + 1):
        for chain in itertools.combinations(ordered, k + 1):
            for points in itertools.combinations(switch_at, k):
                out.append(Policy(((1, chain[0]), *zip(points, chain[1:], strict=True))))
    return out


@dataclasses.dataclass(frozen=True)
class SecondThreshold:
    """What the best two-threshold policy would gain over the recommended one."""

    policy: Policy
    """The best policy with two thresholds (baseline, then sp, then sp+async_tp)."""
    gain: float
    """Total relative regret it saves (point estimate; 0 or less: nothing to gain)."""
    beyond_noise: bool
    """The saving holds in more than ``1 - alpha`` of the resamples."""


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The recommended policy, its regret with intervals, and what the noise leaves open."""

    policy: Policy
    """The policy to run (least rewriting among those the data cannot tell from the best)."""
    config: LabConfig
    """The base config gated to run :attr:`policy`."""
    table: pl.DataFrame
    """:func:`sp_lab.tuning.regret.regret_table` of :attr:`config`: the regret every view shows."""
    total_regret: float
    """Sum over measured token counts of the relative regret."""
    worst_regret: float
    """Largest relative regret at one token count."""
    total_interval: tuple[float, float]
    """95% interval of :attr:`total_regret` over the resamples."""
    worst_interval: tuple[float, float]
    """95% interval of :attr:`worst_regret` over the resamples."""
    best: Policy
    """The policy with the least total regret on the medians themselves."""
    indistinguishable: tuple[Policy, ...]
    """Every one-threshold policy the data cannot tell from :attr:`best` (it included)."""
    second_threshold: SecondThreshold | None
    """The best two-threshold policy and its gain, when sp and sp+async_tp were both measured."""
    candidates: pl.DataFrame
    """``policy, thresholds, total_regret, worst_regret, rewrites, p_as_good, distinguishable`` per policy."""
    n_boot: int
    """Resamples drawn."""
    noise_known: bool
    """Whether the rows carried intervals or spreads (False: every resample equals the medians)."""

    @property
    def threshold(self) -> int | None:
        """The policy's single threshold (``None``: it switches nowhere, "never")."""
        return self.policy.threshold

    @property
    def ambiguous(self) -> bool:
        """More than one policy fits the data within noise."""
        return len(self.indistinguishable) > 1

    def noise_line(self) -> str:
        """What the noise leaves open, in words ("64 and 512 are not distinguishable ...")."""
        if not self.noise_known:
            return "the rows carry no interval: the choice ignores noise"
        if not self.ambiguous:
            return f"no other one-threshold policy is within noise ({self.n_boot} resamples)"
        return (f"{_list_policies(self.indistinguishable)} are not distinguishable at this noise "
                f"({self.n_boot} resamples); chose {self.policy.name} (it rewrites least)")

    def summary(self) -> str:
        """One line: the policy, its worst and summed regret (both in %) with their 95% intervals."""
        return (f"{self.policy.name}: worst regret {100 * self.worst_regret:.1f}% "
                f"(95% interval {100 * self.worst_interval[0]:.1f}-{100 * self.worst_interval[1]:.1f}%), summed over "
                f"the token counts {100 * self.total_regret:.1f}% "
                f"({100 * self.total_interval[0]:.1f}-{100 * self.total_interval[1]:.1f}%)")

    def describe(self) -> str:
        """The summary, what the noise leaves open and what a second threshold would gain, one per line."""
        lines = [self.summary(), self.noise_line()]
        if self.second_threshold is not None:
            s = self.second_threshold
            if s.gain <= 0:
                lines.append("a second threshold would gain nothing")
            else:
                noise = ("rows carry no interval" if not self.noise_known
                         else "beyond noise" if s.beyond_noise else "within noise")
                lines.append(f"a second threshold ({s.policy.name}) would lower the summed regret by {100 * s.gain:.1f} points "
                             f"({noise})")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        """JSON form for an exported file's provenance and ``tune --json``."""
        return {
            "policy": self.policy.to_dict(),
            # where the config fuses, not where the policy first switches ("sp+async_tp everywhere" fuses from 1;
            # "baseline below 64, sp from 64" never fuses)
            "async_tp_min_tokens": NEVER if (fuse_from := fusion_threshold(self.config)) is None else fuse_from,
            "worst_regret": self.worst_regret, "worst_regret_95": list(self.worst_interval),
            "total_regret": self.total_regret, "total_regret_95": list(self.total_interval),
            "not_distinguishable": [p.name for p in self.indistinguishable if p != self.policy],
            "noise": self.noise_line(),
            "second_threshold": None if self.second_threshold is None else {
                "policy": self.second_threshold.policy.name, "gain": self.second_threshold.gain,
                "beyond_noise": self.second_threshold.beyond_noise},
            "resamples": self.n_boot,
        }


def _list_policies(policies: Sequence[Policy]) -> str:
    """Policies in few words: thresholds of one shape share a phrase ("64 and 512 (baseline -> sp+async_tp)")."""
    constants = [p.name for p in policies if not p.thresholds]
    shapes: dict[tuple[str, ...], list[int]] = {}
    for p in policies:
        if p.thresholds:
            shapes.setdefault(tuple(v for _, v in p.steps), []).append(p.thresholds[0] if len(p.thresholds) == 1
                                                                       else p.thresholds)
    phrases = []
    for chain, points in shapes.items():
        names = [str(x) for x in sorted(points)]
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
        phrases.append(f"{listed} ({' -> '.join(chain)})")
    items = phrases + constants
    if len(items) <= 2:
        return " and ".join(items)
    return f"{'; '.join(items[:-1])}; and {items[-1]}"


def _scores(lat: np.ndarray, assign: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Total and worst relative regret per (resample, policy); ``lat[b, t, v]``, ``assign[p, t]``."""
    best = lat.min(axis=2)  # [b, t]
    run = np.take_along_axis(lat[:, None, :, :], assign[None, :, :, None], axis=3)[..., 0]  # [b, p, t]
    rel = run / best[:, None, :] - 1.0
    return rel.sum(axis=2), rel.max(axis=2)


def recommend(rows: pl.DataFrame | Sequence[Mapping], base: LabConfig, *, source: str | None = None,
              n_boot: int = 400, alpha: float = 0.05, seed: int = 0) -> Recommendation:
    """The one-threshold policy to run, chosen with the rows' noise in mind (see the module docstring).

    ``rows``: sweep rows of one setup (``num_tokens, variant, latency_us`` and, for confidence,
    ``ci_low_us / ci_high_us`` or ``p10_us / p90_us / repeats``); ``base``: the config the policy gates.
    Raises ``ValueError`` (saying what to measure) without ``baseline`` rows or a second variant.
    """
    from sp_lab.bench.setups import one_setup

    frame = as_frame(rows)
    # e.g. an FP8 model crosses over at other token counts than its bf16 self, a 1-layer model than its 2 layers
    one_setup(frame, "a policy")
    pooled = medians(frame, source=source)
    tokens = complete_tokens(pooled)
    variants = [v for v in REFERENCE_VARIANTS if v in set(pooled["variant"].to_list())]
    if BASELINE not in variants or len(variants) < 2 or not tokens:
        have = "; ".join(f"{v} at {sorted(pooled.filter(pl.col('variant') == v)['num_tokens'].to_list())}"
                         for v in variants) or "no reference variant"
        raise ValueError(
            f"a policy needs {BASELINE!r} and at least one of {SP!r} / {SP_ASYNC_TP!r} measured at the same "
            f"token counts; the rows have {have}"
        )
    wide = (pooled.filter(pl.col("num_tokens").is_in(tokens) & pl.col("variant").is_in(variants))
            .pivot(on="variant", index="num_tokens", values=["latency_us", "se_us"]).sort("num_tokens"))
    mean = np.stack([wide[f"latency_us_{v}"].to_numpy() for v in variants], axis=1)  # [t, v]
    se = np.stack([wide[f"se_us_{v}"].to_numpy() for v in variants], axis=1)
    noise_known = bool((se > 0).any())
    rng = np.random.default_rng(seed)
    # log-normal around each median: latencies stay positive and a wide interval cannot draw a "best"
    # of almost zero (which would make every other regret explode)
    sigma = np.log1p(se / mean)
    draws = mean[None] * np.exp(sigma[None] * rng.standard_normal((n_boot, *mean.shape)))
    lat = np.concatenate([mean[None], draws])  # index 0: the medians themselves

    singles = candidate_policies(tokens, variants, thresholds=1)
    doubles = [p for p in candidate_policies(tokens, variants, thresholds=2) if len(p.steps) == 3]
    policies = singles + doubles
    column = {v: i for i, v in enumerate(variants)}
    assign = np.array([[column[p.variant_at(t)] for t in tokens] for p in policies])
    total, worst = _scores(lat, assign)
    n1 = len(singles)
    best_i = min(range(n1), key=lambda i: (total[0, i], worst[0, i], policies[i].rewrites(tokens)))
    # as good as the best in at least alpha of the resamples: the data cannot rule it out
    p_as_good = (total[1:, :] <= total[1:, [best_i]] + 1e-12).mean(axis=0)
    close = [i for i in range(n1) if i == best_i or p_as_good[i] >= alpha]
    chosen_i = min(close, key=lambda i: (policies[i].rewrites(tokens), -(policies[i].threshold or math.inf),
                                         total[0, i]))
    chosen = policies[chosen_i]
    config = chosen.to_config(base)
    table = regret_table(frame, config, source=source, warn=False)
    tot, wst = summarize(table)

    second = None
    if doubles:
        d_i = n1 + int(np.argmin(total[0, n1:]))
        gain = float(total[0, chosen_i] - total[0, d_i])
        beyond = bool((total[1:, d_i] < total[1:, chosen_i]).mean() > 1 - alpha) if noise_known else gain > 0
        second = SecondThreshold(policy=policies[d_i], gain=gain, beyond_noise=beyond)

    candidates = pl.DataFrame({
        "policy": [p.name for p in policies],
        "thresholds": [",".join(map(str, p.thresholds)) or NEVER for p in policies],
        "total_regret": total[0], "worst_regret": worst[0],
        "rewrites": [p.rewrites(tokens) for p in policies],
        "p_as_good": np.concatenate([p_as_good[:n1], (total[1:, n1:] <= total[1:, [best_i]] + 1e-12).mean(0)]),
    }).with_columns(distinguishable=pl.col("p_as_good") < alpha)

    def interval(values: np.ndarray) -> tuple[float, float]:
        return (float(np.quantile(values, 0.025)), float(np.quantile(values, 0.975))) if noise_known else (
            float(values[0]), float(values[0]))

    return Recommendation(
        policy=chosen, config=config, table=table, total_regret=tot, worst_regret=wst,
        total_interval=interval(total[1:, chosen_i] if noise_known else total[:1, chosen_i]),
        worst_interval=interval(worst[1:, chosen_i] if noise_known else worst[:1, chosen_i]),
        best=policies[best_i], indistinguishable=tuple(policies[i] for i in close), second_threshold=second,
        candidates=candidates, n_boot=n_boot, noise_known=noise_known)

