"""The serving answer: what a traffic costs under each policy, the saving against baseline with its interval,
the threshold the traffic would pick, and one sentence.

**Speedup** of a policy = seconds the GPUs spend in steps under baseline / under the policy, each policy running
its own schedule of the same traffic (step times feed back into batching). Above 1 the policy is faster.

**Interval** (95%): delta method on the log of that ratio. Each policy's busy time is a weighted sum of row
latencies (a step at a row's count weighs that row, a step between two rows weighs both by the interpolation);
with the rows independent and each schedule held fixed, ``var(log ratio) = sum over rows of (d log T_base /
d row - d log T_policy / d row)^2 * se(row)^2``, where ``se`` is the standard error of a row's median from its own
95% interval (:func:`sp_lab.tuning.regret.medians`: from the p10-p90 spread and repeats for rows without one). A row both policies use counts once, with both weights, so a shared baseline row cancels. Predicted
rows carry no interval: the report says so instead of inventing one.

**Meaningful**: a speedup counts as a benefit (or a loss) only outside 0.97-1.03x (the noise band of the serving
benchmarks this package is checked against) and, where an interval exists, only when the interval excludes 1.

**Threshold**: the per-count threshold is where SP + AsyncTP beats baseline at every larger row count (the rows'
crossover); the traffic-weighted one is the threshold that minimises the baseline schedule's step time when the
steps at and above it run SP + AsyncTP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from sp_lab.serving.policies import ServingPolicy, standard_policies
from sp_lab.serving.scheduler import Schedule, SchedulerLimits, replay_steps, schedule
from sp_lab.tuning.model_sp import lasting_crossover
from sp_lab.vocabulary import BASELINE, SP_ASYNC_TP, describe_threshold

if TYPE_CHECKING:
    from sp_lab.config import LabConfig
    from sp_lab.serving.step_costs import LatencyCurves
    from sp_lab.serving.traffic import Traffic

__all__ = ["NOISE_BAND", "HistogramBin", "Percentiles", "PolicyResult", "ThresholdChoice", "TrafficVerdict",
           "count_weights", "evaluate", "per_count_threshold", "speedup_interval", "step_histogram",
           "traffic_weighted_threshold", "verdict_word"]

NOISE_BAND = (0.97, 1.03)
"""Speedups inside this band are "no meaningful benefit" (the seed's serving runs read 0.98-1.02x as noise)."""
_Z95 = 1.959963984540054


@dataclass(frozen=True)
class Percentiles:
    """p50 / p90 / p99 of a latency, milliseconds."""

    p50_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def of(cls, seconds: np.ndarray) -> Percentiles | None:
        """From per-request seconds (``None`` when there are none)."""
        if seconds.size == 0:
            return None
        p = np.percentile(seconds, [50, 90, 99]) * 1e3
        return cls(float(p[0]), float(p[1]), float(p[2]))


@dataclass(frozen=True)
class PolicyResult:
    """One policy on the traffic."""

    policy: str
    """Its name (:mod:`sp_lab.serving.policies`)."""
    busy_s: float
    """Seconds spent in steps."""
    span_s: float
    """First arrival to last token."""
    steps: int
    """Steps run."""
    output_tokens: int
    """Tokens generated (0 for a step list)."""
    ttft: Percentiles | None
    """Time to first token (``None`` for a step list)."""
    tpot: Percentiles | None
    """Time per output token after the first."""
    speedup: float
    """Baseline's busy time / this policy's (module docstring)."""
    interval: tuple[float, float] | None
    """95% interval of ``speedup`` (``None``: the rows carry no interval)."""
    interpolated_share: float
    """Share of this policy's step time priced between two rows."""

    @property
    def throughput_tok_s(self) -> float:
        """Output tokens per second over the span."""
        return self.output_tokens / self.span_s if self.span_s > 0 else math.nan


@dataclass(frozen=True)
class HistogramBin:
    """Steps of ``low..high`` tokens under baseline: how many, and their share of steps and of step time."""

    low: int
    high: int
    steps: int
    time_s: float
    step_share: float
    time_share: float


@dataclass(frozen=True)
class ThresholdChoice:
    """The per-count threshold beside the traffic-weighted one, with the baseline schedule's time under each."""

    per_count: int | None
    """The rows' crossover (``None``: SP + AsyncTP never wins to the largest row)."""
    traffic_weighted: int | None
    """The threshold minimising this traffic's step time (``None``: never)."""
    per_count_s: float
    """Baseline schedule's step time with SP + AsyncTP from ``per_count``."""
    traffic_weighted_s: float
    """... from ``traffic_weighted``."""
    never_s: float
    """... with baseline everywhere."""


@dataclass(frozen=True)
class TrafficVerdict:
    """The whole answer; :meth:`text` prints it, :meth:`to_dict` is its JSON form."""

    traffic: str
    """What was priced (:meth:`Traffic.describe` or the step list)."""
    source: str
    """The rows' source: measured, predicted, ..."""
    provenance: str
    """Where the rows come from."""
    shared_terms: str
    """What every policy pays alike beyond the rows (modelled), or "none"."""
    limits: SchedulerLimits | None
    """Scheduler limits (``None`` for a step list)."""
    interval_method: str
    """How the intervals were computed (or why there are none)."""
    results: tuple[PolicyResult, ...]
    """Baseline first."""
    histogram: tuple[HistogramBin, ...]
    """Baseline's step sizes."""
    threshold: ThresholdChoice
    judged: str
    """The policy the sentence judges (SP + AsyncTP from the per-count threshold)."""
    sentence: str
    """Does it pay, by how much, where the time goes."""
    schedules: dict[str, Schedule] = field(default_factory=dict, compare=False, repr=False)
    """Each policy's schedule (plots)."""

    def result(self, policy: str) -> PolicyResult:
        """The named policy's result; ``KeyError`` naming the policies."""
        for r in self.results:
            if r.policy == policy:
                return r
        raise KeyError(f"no policy {policy!r}; have {[r.policy for r in self.results]}")

    def text(self) -> str:
        """The report as plain text (what ``python -m sp_lab traffic`` prints)."""
        kind = self.source.upper()
        lines = [f"{kind} step costs ({self.provenance})", f"traffic: {self.traffic}"]
        if self.limits is not None:
            lines.append(f"scheduler: vLLM-style continuous batching, max_num_batched_tokens="
                         f"{self.limits.max_num_batched_tokens}, max_num_seqs={self.limits.max_num_seqs}")
        header = (f"{'policy':<40}{'speedup':>9}{'95% interval':>17}{'busy s':>10}{'steps':>9}"
                  f"{'TTFT p50/p90/p99 ms':>26}{'TPOT p50/p90/p99 ms':>24}")
        lines += [f"added to every step: {self.shared_terms}", "", header]
        for r in self.results:
            ci = "n/a" if r.interval is None else f"{r.interval[0]:.3f}-{r.interval[1]:.3f}"
            ttft = "-" if r.ttft is None else f"{r.ttft.p50_ms:.0f}/{r.ttft.p90_ms:.0f}/{r.ttft.p99_ms:.0f}"
            tpot = "-" if r.tpot is None else f"{r.tpot.p50_ms:.2f}/{r.tpot.p90_ms:.2f}/{r.tpot.p99_ms:.2f}"
            lines.append(f"{r.policy:<40}{r.speedup:>8.3f}x{ci:>17}{r.busy_s:>10.2f}{r.steps:>9}{ttft:>26}{tpot:>24}")
        between = ", ".join(f"{r.policy} {100 * r.interpolated_share:.0f}%" for r in self.results)
        lines += ["", f"interval: {self.interval_method}",
                  f"interpolation: linear in the token count between rows; share of step time priced between rows: {between}",
                  "", "step sizes under baseline (tokens: steps, share of steps, share of time):"]
        t = self.threshold.per_count
        for b in self.histogram:
            side = "" if t is None else ("  below threshold" if b.high < t else
                                         "  at/above threshold" if b.low >= t else "  spans the threshold")
            lines.append(f"  {b.low:>6}-{b.high:<6} {b.steps:>9} {100 * b.step_share:6.1f}% {100 * b.time_share:6.1f}%"
                         f"{side}")
        th = self.threshold
        thresholds = (f"threshold per token count (the rows' crossover): {describe_threshold(th.per_count)}; "
                      f"traffic-weighted: {describe_threshold(th.traffic_weighted)} (baseline schedule: "
                      f"{th.per_count_s:.2f} s vs {th.traffic_weighted_s:.2f} s; never {th.never_s:.2f} s)")
        lines += ["", thresholds, "", f"[{self.source}] {self.sentence}"]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (an exported config's ``traffic`` section, the report)."""
        import dataclasses

        return {"source": self.source, "provenance": self.provenance, "traffic": self.traffic,
                "shared_terms": self.shared_terms,
                "limits": None if self.limits is None else dataclasses.asdict(self.limits),
                "interval_method": self.interval_method, "judged": self.judged, "sentence": self.sentence,
                "threshold": dataclasses.asdict(self.threshold),
                "results": [dataclasses.asdict(r) for r in self.results],
                "histogram": [dataclasses.asdict(b) for b in self.histogram]}


# ------------------------------------------------------------------------------------------------ pieces
def per_count_threshold(curves: LatencyCurves) -> int | None:
    """Where SP + AsyncTP beats baseline at every larger count both have rows for (``None``: never)."""
    a, b = curves.curve(SP_ASYNC_TP), curves.curve(BASELINE)
    common = np.intersect1d(a.tokens, b.tokens)
    return lasting_crossover(zip(common.tolist(), (a.at(common) < b.at(common)).tolist(), strict=True))


def _run_costs(curves: LatencyCurves, variant: str, tokens: np.ndarray) -> np.ndarray:
    curves.check_counts(variant, tokens)
    return curves.curve(variant).at(tokens)


def traffic_weighted_threshold(curves: LatencyCurves, run_tokens: np.ndarray, run_steps: np.ndarray
                               ) -> tuple[int | None, float, dict[int | None, float]]:
    """The threshold minimising ``sum(steps * cost)`` over runs when runs of at least it run SP + AsyncTP and the
    rest baseline; candidates are the rows' counts and "never". Returns the best, its time (s) and every
    candidate's time. Ties go to the larger threshold (less rewriting)."""
    order = np.argsort(run_tokens, kind="stable")
    tokens, steps = run_tokens[order], run_steps[order]
    base = _run_costs(curves, BASELINE, tokens) * steps * 1e-6
    fused = _run_costs(curves, SP_ASYNC_TP, tokens) * steps * 1e-6
    below = np.concatenate([[0.0], np.cumsum(base)])      # baseline on the first i runs
    above = np.concatenate([np.cumsum(fused[::-1])[::-1], [0.0]])  # fused on runs i..
    candidates = sorted(set(curves.curve(SP_ASYNC_TP).tokens.tolist()) & set(curves.curve(BASELINE).tokens.tolist()))
    times: dict[int | None, float] = {None: float(below[-1])}
    for c in candidates:
        i = int(np.searchsorted(tokens, c, side="left"))
        times[c] = float(below[i] + above[i])
    best: int | None = None
    for c in sorted(candidates, reverse=True):  # from the largest: ties keep the larger threshold
        if times[c] < times[best] * (1 - 1e-12):
            best = c
    return best, times[best], times


def step_histogram(sched: Schedule) -> tuple[HistogramBin, ...]:
    """Steps by token count in power-of-two bins (1, 2-3, 4-7, ...), with shares of steps and of step time."""
    edges = np.floor(np.log2(sched.run_tokens)).astype(int)
    total_steps, total_s = sched.run_steps.sum(), sched.run_time_s.sum()
    bins = []
    for e in range(int(edges.max()) + 1):
        sel = edges == e
        steps = int(sched.run_steps[sel].sum())
        if steps == 0:
            continue
        time_s = float(sched.run_time_s[sel].sum())
        bins.append(HistogramBin(2 ** e, 2 ** (e + 1) - 1, steps, time_s, steps / total_steps, time_s / total_s))
    return tuple(bins)


def count_weights(sched: Schedule, counts: Sequence[int]) -> dict[int, float]:
    """Share of ``sched``'s step time at each of ``counts`` (e.g. the token counts a regret table has): a run
    between two counts splits its time between them as linear interpolation does. What weights a regret by a
    traffic (:func:`sp_lab.tuning.regret.traffic_regret`); ``ValueError`` for steps outside ``counts``."""
    from sp_lab.serving.step_costs import Curve

    grid = np.unique(np.asarray(counts, dtype=np.int64))
    outside = sched.run_tokens[(sched.run_tokens < grid[0]) | (sched.run_tokens > grid[-1])]
    if outside.size:
        raise ValueError(f"steps of {sorted(set(outside.tolist()))[:5]} tokens lie outside the counts "
                         f"{int(grid[0])}..{int(grid[-1])}: measure those counts to weight by this traffic")
    lo, hi, w = Curve("", grid, np.zeros(grid.size), np.zeros(grid.size)).weights(sched.run_tokens)
    share = np.zeros(grid.size)
    np.add.at(share, lo, w * sched.run_time_s)
    np.add.at(share, hi, (1 - w) * sched.run_time_s)
    share /= sched.run_time_s.sum()
    return {int(t): float(s) for t, s in zip(grid.tolist(), share.tolist(), strict=True)}


def _gradient(curves: LatencyCurves, policy: ServingPolicy, sched: Schedule) -> dict[tuple[str, int], float]:
    """d(busy microseconds) / d(row latency) for every row the policy's steps are priced from."""
    grad: dict[tuple[str, int], float] = {}
    tokens, steps = sched.run_tokens, sched.run_steps.astype(float)
    variants = np.array([policy.variant_at(int(t)) for t in tokens])
    for variant in np.unique(variants):
        sel = variants == variant
        lo, hi, w = curves.curve(str(variant)).weights(tokens[sel])
        for idx, weight in ((lo, w * steps[sel]), (hi, (1 - w) * steps[sel])):
            for i, g in zip(idx.tolist(), weight.tolist(), strict=True):
                if g:
                    grad[(str(variant), i)] = grad.get((str(variant), i), 0.0) + g
    return grad


def speedup_interval(curves: LatencyCurves, base: tuple[ServingPolicy, Schedule],
                     other: tuple[ServingPolicy, Schedule]) -> tuple[float, float] | None:
    """95% interval of baseline busy / ``other`` busy by the delta method (module docstring); ``None`` when no row
    used carries a standard error."""
    (bp, bs), (op, os_) = base, other
    tb, to = bs.busy_s * 1e6, os_.busy_s * 1e6
    gb, go = _gradient(curves, bp, bs), _gradient(curves, op, os_)
    var, any_se = 0.0, False
    for key in set(gb) | set(go):
        se = float(curves.curve(key[0]).se_us[key[1]])
        any_se |= se > 0
        var += ((gb.get(key, 0.0) / tb - go.get(key, 0.0) / to) * se) ** 2
    if not any_se:
        return None
    ratio, half = tb / to, _Z95 * math.sqrt(var)
    return ratio * math.exp(-half), ratio * math.exp(half)


def _interpolated_share(curves: LatencyCurves, policy: ServingPolicy, sched: Schedule) -> float:
    variants = np.array([policy.variant_at(int(t)) for t in sched.run_tokens])
    between = np.zeros(sched.run_tokens.size, dtype=bool)
    for variant in np.unique(variants):
        sel = variants == variant
        between[sel] = curves.interpolated(str(variant), sched.run_tokens[sel])
    return float(sched.run_time_s[between].sum() / sched.run_time_s.sum())


def verdict_word(speedup: float, interval: tuple[float, float] | None) -> str:
    """"pays", "costs" or "no meaningful benefit": ``speedup`` outside :data:`NOISE_BAND` and its 95% ``interval``
    (when there is one) clear of 1.0, or neither."""
    lo, hi = NOISE_BAND
    uncertain = interval is not None and interval[0] <= 1.0 <= interval[1]
    if speedup >= hi and not uncertain:
        return "pays"
    if speedup <= lo and not uncertain:
        return "costs"
    return "no meaningful benefit"


def _sentence(judged: PolicyResult, histogram: Sequence[HistogramBin], threshold: int | None, source: str) -> str:
    verdict = verdict_word(judged.speedup, judged.interval)
    ci = "" if judged.interval is None else f" (95% interval {judged.interval[0]:.2f}-{judged.interval[1]:.2f}x)"
    if threshold is None:
        where = "SP + AsyncTP never wins at a row count, so this policy runs baseline at every step"
    else:
        below = sum(b.time_share for b in histogram if b.high < threshold)
        where = (f"{100 * below:.0f}% of baseline's step time is in steps under {threshold} tokens, "
                 "where the policy runs baseline")
    big = max(histogram, key=lambda b: b.time_share)
    return (f"{judged.policy}: {verdict} on this traffic, {judged.speedup:.2f}x{ci} from {source} rows; {where}; "
            f"the most time goes to steps of {big.low}-{big.high} tokens ({100 * big.time_share:.0f}%).")


# ---------------------------------------------------------------------------------------------- the answer
def evaluate(curves: LatencyCurves, traffic: Traffic | Sequence[int], *,
             limits: SchedulerLimits | None = None, policies: Sequence[ServingPolicy] | None = None,
             config: LabConfig | None = None) -> TrafficVerdict:
    """Price ``traffic`` (requests, or a recorded list of per-step token counts) under each policy.

    ``policies`` default to :func:`~sp_lab.serving.policies.standard_policies` with the rows' crossover as the
    threshold (plus the traffic-weighted threshold when it differs, and ``config`` as the tuned config). Counts the
    steps reach outside the rows are refused (:meth:`LatencyCurves.check_counts`).
    """
    from sp_lab.serving.traffic import Traffic

    is_requests = isinstance(traffic, Traffic)
    limits = (limits or SchedulerLimits()) if is_requests else None
    max_tokens = limits.max_num_batched_tokens if limits is not None else int(np.max(traffic))
    per_count = per_count_threshold(curves)
    if policies is None:
        policies = standard_policies(per_count, variants=set(curves.curves), config=config)
    if policies[0].variant_at(1) != BASELINE or policies[0].plan is None or policies[0].plan.thresholds:
        raise ValueError(f"the first policy must be baseline everywhere (speedups are against it), got {policies[0].name}")

    def run(policy: ServingPolicy) -> Schedule:
        if is_requests:
            return schedule(traffic, limits, curves.price(policy.variants(max_tokens), max_tokens))  # type: ignore[arg-type]
        return replay_steps(traffic, curves.price(policy.variants(max_tokens), max_tokens, counts=traffic))  # type: ignore[arg-type]

    schedules = {p.name: run(p) for p in policies}
    base_sched = schedules[policies[0].name]
    weighted, weighted_s, times = traffic_weighted_threshold(curves, base_sched.run_tokens, base_sched.run_steps)
    threshold_names = {p.threshold for p in policies if p.plan is not None and p.name.startswith(f"{SP_ASYNC_TP} from")}
    if weighted not in threshold_names:
        extra = ServingPolicy.from_threshold(weighted)
        extra = ServingPolicy(extra.name + " (traffic-weighted)", plan=extra.plan, threshold=weighted)
        policies = [*policies, extra]
        schedules[extra.name] = run(extra)
    results = []
    for p in policies:
        s = schedules[p.name]
        results.append(PolicyResult(
            policy=p.name, busy_s=s.busy_s, span_s=s.span_s, steps=s.num_steps,
            output_tokens=int(s.output_tokens.sum()), ttft=Percentiles.of(s.ttft_s()), tpot=Percentiles.of(s.tpot_s()),
            speedup=base_sched.busy_s / s.busy_s,
            interval=None if p is policies[0] else speedup_interval(curves, (policies[0], base_sched), (p, s)),
            interpolated_share=_interpolated_share(curves, p, s)))
    has_se = any(float(c.se_us.max(initial=0.0)) > 0 for c in curves.curves.values())
    method = ("delta method on log(speedup) from each row's standard error (its 95% interval / 3.92, or for rows "
              "without one its p10-p90 spread and repeats), rows independent, each policy's schedule held fixed"
              if has_se else
              f"none: {curves.source} rows carry no interval (the model's inputs are uncertain, see docs/predictions.md)")
    histogram = step_histogram(base_sched)
    judged_name = ServingPolicy.from_threshold(per_count).name
    judged = next(r for r in results if r.policy == judged_name) if judged_name in schedules else results[0]
    choice = ThresholdChoice(per_count=per_count, traffic_weighted=weighted,
                             per_count_s=times.get(per_count, times[None]), traffic_weighted_s=weighted_s,
                             never_s=times[None])
    described = traffic.describe() if is_requests else f"recorded step list, {len(traffic)} steps"  # type: ignore[union-attr]
    return TrafficVerdict(
        traffic=described, source=curves.source, provenance=curves.provenance, shared_terms=curves.shared.description,
        limits=limits, interval_method=method, results=tuple(results), histogram=histogram, threshold=choice,
        judged=judged.policy, sentence=_sentence(judged, histogram, per_count, curves.source), schedules=schedules)
