"""Timing several variants at one token count in turns, until each median is known well enough.

A sweep that measured each variant in a block of calls, minutes apart, compared the machine's moods as
much as the variants. :func:`interleave` calls each variant in turn (one timed call per variant per
round, the order rotated by one every round), takes the slowest rank's time for each call (the ranks
start every call together), and goes on until the 95% interval of every variant's median is within a
stated fraction of it, or the time share of this token count is spent (:class:`StopRule`). Fewer than
:data:`~sp_lab.bench.timing.MIN_CI_SAMPLES` calls have no 95% interval: rows then record none, and the rounds
never stop on one.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from sp_lab.bench.timing import MIN_CI_SAMPLES, CallSampler, median_ci, weakest_method

CI_LEVEL = 0.95
"""Confidence level of the interval recorded around every median (``ci_low_us`` / ``ci_high_us``)."""


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclasses.dataclass(frozen=True)
class PointTiming:
    """What :func:`interleave` measured for one variant at one token count (step latencies, us)."""

    samples_us: tuple[float, ...]
    """One per call: the slowest rank's time for that call."""
    method: str
    """How the calls were timed (``perf_counter``, ``cuda_events``, ``cuda_graph``)."""
    note: str
    """Timing fallbacks (e.g. why CUDA-graph capture failed) and why the rounds stopped."""

    def summary(self) -> dict[str, float | None]:
        """median, p10, p90 and the median's 95% interval, as row columns; the interval is ``None`` (null)
        below :data:`~sp_lab.bench.timing.MIN_CI_SAMPLES` samples, which have none."""
        ordered = sorted(self.samples_us)
        deciles = statistics.quantiles(ordered, n=10, method="inclusive") if len(ordered) > 1 else ordered * 9
        lo, hi = median_ci(ordered, CI_LEVEL) if len(ordered) >= MIN_CI_SAMPLES else (None, None)
        return {"latency_us": statistics.median(ordered), "p10_us": deciles[0], "p90_us": deciles[-1],
                "ci_low_us": lo, "ci_high_us": hi}


@dataclasses.dataclass
class StopRule:
    """When a token count's interleaved rounds stop: narrow enough intervals, or its share of the budget."""

    repeats: int
    max_repeats: int
    ci_width: float
    budget_s: float | None
    points_left: int
    spent_s: float = 0.0

    def share_s(self) -> float | None:
        """Seconds this token count may spend (the budget left, shared by the token counts left)."""
        if self.budget_s is None:
            return None
        return max(self.budget_s - self.spent_s, 0.0) / max(self.points_left, 1)

    def reason(self, samples: Mapping[str, list[float]], elapsed_s: float, share_s: float | None) -> str | None:
        """Why to stop now, or ``None`` to go on."""
        n = min(len(s) for s in samples.values())
        if n < self.repeats:
            return None
        if n >= MIN_CI_SAMPLES:
            widths = []
            for s in samples.values():
                lo, hi = median_ci(s, CI_LEVEL)
                widths.append((hi - lo) / statistics.median(s))
            if max(widths) <= self.ci_width:
                return f"intervals within {self.ci_width:.0%} of the medians after {n} rounds"
            spread = f"widest interval {max(widths):.0%} of its median"
        else:  # the range of fewer samples is no 95% interval: never stop on it, never report it as one
            spread = f"too few rounds for a {CI_LEVEL:.0%} interval (fewer than {MIN_CI_SAMPLES})"
        if n >= self.max_repeats:
            return f"max_repeats={self.max_repeats} reached; {spread}"
        if share_s is not None and elapsed_s >= share_s:
            return f"time budget spent after {n} rounds; {spread}"
        return None


def interleave(calls: Mapping[str, Callable[[], object]], *, device: torch.device, warmup: int,
                cuda_graph: bool, stop: StopRule, share: float = 1.0, ends_point: bool = True) -> dict[str, PointTiming]:
    """Time ``calls`` (variant -> callable at one token count) in rotating turns until ``stop`` says so.

    Collective: every rank calls it with the same variants. Each round times one call of every variant,
    the order shifted by one each round; the slowest rank's time per call is the step's, and the weakest rank's
    timing method is the row's (with every rank's fallback note). Rank 0's clock and decision are broadcast, so
    every rank leaves the loop after the same round.

    A token count measured in batches (variants compiled one after the other) gives each batch ``share`` of
    what is left of its time budget; the last (``ends_point``) closes the token count.
    """
    names = list(calls)
    for fn in calls.values():
        fn()  # the first call compiles the range; never timed
    samplers = {v: CallSampler(fn, device=device, warmup=warmup, cuda_graph=cuda_graph)
                for v, fn in calls.items()}
    steps: dict[str, list[float]] = {v: [] for v in names}
    share_s = stop.share_s()
    share_s = None if share_s is None else share * share_s
    start, rounds, why = time.monotonic(), 0, None
    while why is None:
        order = names[rounds % len(names):] + names[:rounds % len(names)]
        mine = {v: samplers[v].sample() for v in order}
        for v, us in _slowest_rank(mine).items():
            steps[v].append(us)
        rounds += 1
        why = broadcast(stop.reason(steps, time.monotonic() - start, share_s))
    for sampler in samplers.values():
        sampler.finish()
    stop.spent_s += time.monotonic() - start
    if ends_point:
        stop.points_left -= 1
    # A row is timed as its weakest rank was, with every rank's fallback note.
    timed = every_rank({v: (samplers[v].method, samplers[v].note) for v in names})
    return {v: PointTiming(samples_us=tuple(steps[v]), method=weakest_method(r[v][0] for r in timed),
                           note="; ".join(n for n in (*sorted({r[v][1] for r in timed if r[v][1]}), why) if n))
            for v in names}


def every_rank(mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order (this rank's alone without a group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def _slowest_rank(mine: dict[str, float]) -> dict[str, float]:
    """Per variant, the largest of the ranks' times for this round's call."""
    everyone = every_rank(mine)
    return {v: max(r[v] for r in everyone) for v in mine}
