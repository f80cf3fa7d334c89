"""Latency timers: warm up, then the median of repeats, aligned across tensor-parallel ranks.

- CPU: ``time.perf_counter`` around each call, with a ``dist.barrier`` before every repeat so all
  ranks start a step together (otherwise a rank that arrives late makes the others' collectives look
  slow, and the numbers measure skew rather than the step).
- CUDA: the call is captured once into a CUDA graph and replayed, timed with CUDA events. At small
  token counts an eager forward is bound by host launch overhead (docs/measured-h200.md: ~0.2-0.3 ms
  per eager fused op), which would swamp exactly the regime the threshold is about. If capture fails
  (an op that syncs with the host, a collective backend that cannot be captured), timing falls back to
  events around eager calls and says so in ``Timing.method`` and ``Timing.note``.

A TP step is as slow as its slowest rank. A sweep row (:func:`sp_lab.bench.interleave.interleave`) takes,
for every call, the slowest rank's time, and then the median over calls; :func:`reduce_across_ranks` is
the coarser form for a whole :class:`Timing` of one rank (the rank with the largest median wins).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

TIMING_METHODS = ("perf_counter", "cuda_events", "cuda_graph")


def weakest_method(methods: Iterable[str]) -> str:
    """The method a step's timing really had when its ranks timed their calls differently: the weakest (one rank
    that could not capture a CUDA graph puts its eager host overhead into every step it takes part in)."""
    return min(methods, key=TIMING_METHODS.index)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Latency of one callable, in microseconds."""

    median_us: float
    """Median over ``repeats`` (after :func:`reduce_across_ranks`: the max of the per-rank medians)."""
    p10_us: float
    """10th percentile (of the rank with the largest median, after the reduction)."""
    p90_us: float
    """90th percentile (likewise)."""
    repeats: int
    """Number of timed calls per rank."""
    method: str
    """One of ``TIMING_METHODS``: how the calls were timed."""
    note: str = ""
    """Why a fallback happened (e.g. the CUDA-graph capture error), empty otherwise."""
    rank_medians_us: tuple[float, ...] = ()
    """Per-rank medians, in rank order (filled by :func:`reduce_across_ranks`)."""


def _summarize(samples_us: list[float], *, method: str, note: str = "") -> Timing:
    if not samples_us:
        raise ValueError("no timing samples: repeats must be >= 1")
    ordered = sorted(samples_us)
    if len(ordered) >= 2:
        deciles = statistics.quantiles(ordered, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    else:
        p10 = p90 = ordered[0]
    return Timing(
        median_us=statistics.median(ordered),
        p10_us=p10,
        p90_us=p90,
        repeats=len(ordered),
        method=method,
        note=note,
    )


MIN_CI_SAMPLES = 6
"""Fewest samples that have a 95% interval of their median: the widest interval order statistics give, the
range (min, max) of ``n`` samples, covers the median with probability ``1 - 2**(1 - n)`` only, 0% at one
sample and 94% at five."""


def median_ci(samples_us: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free ``level`` confidence interval of the median of ``samples_us``.

    Order statistics: the median lies between the ``l``-th and ``u``-th smallest of ``n`` samples with
    probability ``level`` when ``l, u = n/2 -/+ z*sqrt(n)/2`` (the binomial(n, 1/2) normal approximation).
    Timing noise is skewed (a preempted call is 10x slower, never 10x faster), which is why the interval
    is taken from the samples rather than from a mean and a standard deviation.

    Fewer than :data:`MIN_CI_SAMPLES` samples give their range ``(min, max)``, which is *not* a 95%
    interval (it covers the median with probability ``1 - 2**(1 - n)``: 0% for one sample, 94% for five):
    callers that need one check ``len(samples_us) >= MIN_CI_SAMPLES`` first (a sweep row then stores no
    interval, and :class:`sp_lab.bench.interleave.StopRule` never stops on it).
    """
    ordered = sorted(samples_us)
    n = len(ordered)
    if n == 0:
        raise ValueError("no timing samples: repeats must be >= 1")
    if n < MIN_CI_SAMPLES:
        return ordered[0], ordered[-1]
    z = statistics.NormalDist().inv_cdf(0.5 + level / 2)
    half = z * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half) - 1)
    hi = min(n - 1, math.ceil(n / 2 + half))
    return ordered[lo], ordered[hi]


def check_counts(warmup: int, repeats: int) -> None:
    """Refuse a negative ``warmup`` or fewer than one repeat (the timers here and a sweep's own checks)."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")


def _maybe_barrier(barrier: bool, group: dist.ProcessGroup | None) -> None:
    if barrier and dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


class CallSampler:
    """Times single calls of ``fn`` on demand, so that several callables can be timed in turn.

    Construction warms ``fn`` up (``warmup`` untimed calls; on CUDA on a side stream, then captures it
    into a CUDA graph when ``cuda_graph``, falling back to eager calls with the reason in ``note``).
    :meth:`sample` then times ``calls`` back-to-back calls (one graph replay holding them all on CUDA) and
    returns the time per call, after a barrier so that the ranks' timed regions line up. Several calls per
    sample amortise what one sample costs by itself (a graph launch is a few microseconds, which a
    decode-sized matmul or attention kernel would otherwise carry in full). A sweep interleaves the samplers of its variants (each variant in turn, the
    order rotated every round) so that slow drifts of the machine hit every variant alike.
    """

    def __init__(
        self,
        fn: Callable[[], object],
        *,
        device: torch.device | str = "cpu",
        warmup: int = 3,
        cuda_graph: bool = True,
        barrier: bool = True,
        group: dist.ProcessGroup | None = None,
        calls: int = 1,
    ) -> None:
        check_counts(warmup, 1)
        if calls < 1:
            raise ValueError(f"calls per sample must be >= 1, got {calls}")
        self._barrier, self._group, self.calls = barrier, group, calls
        self.cuda = torch.device(device).type == "cuda"
        self.method, self.note = ("cuda_events" if self.cuda else "perf_counter"), ""
        self._run = _repeated(fn, calls)
        if not self.cuda:
            for _ in range(warmup):
                fn()
            return
        if not torch.cuda.is_available():
            raise RuntimeError("CallSampler on a CUDA device needs CUDA; time on the CPU instead")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 1)):  # capture needs at least one eager run first
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if cuda_graph:
            self._capture(self._run)
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def _capture(self, fn: Callable[[], object]) -> None:
        rng = torch.cuda.default_generators[torch.cuda.current_device()]
        rng_before = rng.clone_state() if hasattr(rng, "clone_state") else None
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
            torch.cuda.synchronize()
            graph.replay()  # one untimed replay: the first can include lazy work
            torch.cuda.synchronize()
            self._graph, self._run, self.method = graph, graph.replay, "cuda_graph"
        except Exception as e:  # noqa: BLE001 - capture fails in many ways; each means "time eagerly"
            self.note = f"CUDA-graph capture failed, timed eager calls: {type(e).__name__}: {e}"[:500]
            # A capture that fails midway leaves the device's default generator in "capturing" state
            # (capture_end raises before its epilogue) and every later CUDA random op in the process
            # fails with "Offset increment outside graph capture": put back the state from before.
            if rng_before is not None:
                rng.graphsafe_set_state(rng_before)
            del graph
            torch.cuda.synchronize()

    def sample(self) -> float:
        """One timed call, in microseconds."""
        if not self.cuda:
            _maybe_barrier(self._barrier, self._group)
            t0 = time.perf_counter()
            self._run()
            return (time.perf_counter() - t0) * 1e6 / self.calls
        torch.cuda.synchronize()
        _maybe_barrier(self._barrier, self._group)
        self._start.record()
        self._run()
        self._end.record()
        self._end.synchronize()
        return self._start.elapsed_time(self._end) * 1e3 / self.calls  # ms -> us

    def finish(self) -> None:
        """The closing barrier, so that no rank leaves the timed region while another is in it."""
        _maybe_barrier(self._barrier, self._group)


def _repeated(fn: Callable[[], object], calls: int) -> Callable[[], object]:
    if calls == 1:
        return fn

    def run() -> None:
        for _ in range(calls):
            fn()

    return run


def _time_with(sampler: CallSampler, repeats: int) -> Timing:
    samples = [sampler.sample() for _ in range(repeats)]
    sampler.finish()
    return _summarize(samples, method=sampler.method, note=sampler.note)


def time_cpu(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    repeats: int = 10,
    barrier: bool = True,
    group: dist.ProcessGroup | None = None,
    calls: int = 1,
) -> Timing:
    """Time ``fn()`` on this rank with ``perf_counter``: ``warmup`` untimed calls, then ``repeats`` timed
    samples of ``calls`` calls each (per-call times).

    With ``barrier`` (and an initialized process group) every sample starts after a barrier, so the
    ranks' timed regions line up. Returns this rank's :class:`Timing`; combine ranks with
    :func:`reduce_across_ranks`.
    """
    check_counts(warmup, repeats)
    sampler = CallSampler(fn, device="cpu", warmup=warmup, barrier=barrier, group=group, calls=calls)
    return _time_with(sampler, repeats)


def time_cuda(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    repeats: int = 10,
    cuda_graph: bool = True,
    barrier: bool = True,
    group: dist.ProcessGroup | None = None,
    calls: int = 1,
) -> Timing:
    """Time ``fn()`` on the current CUDA device with CUDA events, replaying a CUDA graph of it if possible.

    Warm-up runs eagerly on a side stream (as graph capture requires: it also lets lazy
    initialisation and autotuning happen outside the capture). If ``cuda_graph`` and capture
    succeeds, each timed repeat is one ``graph.replay()`` of ``calls`` captured calls; otherwise each
    is ``calls`` back-to-back eager calls, and ``method`` is ``"cuda_events"`` (with the capture
    error in ``note`` when capture failed). Times are per call.
    """
    check_counts(warmup, repeats)
    if not torch.cuda.is_available():
        raise RuntimeError("time_cuda needs a CUDA device; use time_cpu on CPU (or time_fn to pick)")
    sampler = CallSampler(fn, device=torch.device("cuda", torch.cuda.current_device()), warmup=warmup,
                          cuda_graph=cuda_graph, barrier=barrier, group=group, calls=calls)
    return _time_with(sampler, repeats)


def time_fn(
    fn: Callable[[], object],
    *,
    device: torch.device | str,
    warmup: int = 3,
    repeats: int = 10,
    cuda_graph: bool = True,
    barrier: bool = True,
    group: dist.ProcessGroup | None = None,
    calls: int = 1,
) -> Timing:
    """Pick :func:`time_cuda` for a CUDA ``device`` and :func:`time_cpu` otherwise."""
    if torch.device(device).type == "cuda":
        return time_cuda(fn, warmup=warmup, repeats=repeats, cuda_graph=cuda_graph, barrier=barrier, group=group,
                         calls=calls)
    return time_cpu(fn, warmup=warmup, repeats=repeats, barrier=barrier, group=group, calls=calls)


def reduce_across_ranks(timing: Timing, group: dist.ProcessGroup | None = None) -> Timing:
    """Combine every rank's :class:`Timing` into the step's: the rank with the largest median wins.

    Sweeps do not use it: :func:`sp_lab.bench.interleave.interleave` takes the slowest rank per call, then the
    median over calls (a rank slow on different calls than another is not hidden by its own median).

    Collective: every rank of ``group`` must call it; every rank gets the same result. Without an
    initialized process group it returns ``timing`` with ``rank_medians_us`` filled.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return dataclasses.replace(timing, rank_medians_us=(timing.median_us,))
    gathered: list[Timing | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, timing, group=group)
    slowest = max(gathered, key=lambda t: t.median_us)
    methods = {t.method for t in gathered}
    notes = sorted({t.note for t in gathered if t.note})
    return dataclasses.replace(
        slowest,
        method=weakest_method(methods),
        note="; ".join(notes),
        rank_medians_us=tuple(t.median_us for t in gathered),
    )
