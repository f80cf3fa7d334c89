"""What arrives at the server: requests, and when they arrive.

A :class:`Request` is what a serving benchmark sends: an arrival time, a prompt length and an output length in
tokens. :class:`Traffic` is a list of them plus how they are released:

- **open loop** (``concurrency=None``): each request arrives at its own ``arrival_s`` -- a Poisson process at a
  rate (:func:`poisson_arrivals`, what ``vllm bench serve --request-rate R`` sends) or a recorded trace;
- **closed loop** (``concurrency=C``): at most ``C`` requests are in flight; a request is sent at its
  ``arrival_s`` or when an earlier one finishes, whichever is later (``vllm bench serve --max-concurrency C``,
  whose default rate is infinite: every ``arrival_s`` is 0).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Request", "Traffic", "poisson_arrivals"]


@dataclass(frozen=True)
class Request:
    """One request: when it is sent and how many tokens go in and come out."""

    arrival_s: float
    """Seconds from the start of the run (open loop); the earliest send time under a concurrency cap."""
    prompt_tokens: int
    """Tokens of the prompt (prefilled, possibly in chunks)."""
    output_tokens: int
    """Tokens generated; the first comes out of the step that finishes the prefill, each further one from a
    decode step."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"arrival_s must be a finite number of seconds >= 0, got {self.arrival_s!r}")
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class Traffic:
    """Requests in arrival order and how they are released (see the module docstring)."""

    requests: tuple[Request, ...]
    """Sorted by ``arrival_s``."""
    concurrency: int | None = None
    """At most this many requests in flight (closed loop); ``None``: open loop."""
    name: str = "traffic"
    """What it is, for labels: a workload name or a file name."""
    source: str = ""
    """Where its lengths and arrivals come from (a dataset's published statistics, a file, a seed)."""

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError(f"{self.name}: traffic needs at least one request")
        times = [r.arrival_s for r in self.requests]
        if any(b < a for a, b in itertools.pairwise(times)):
            raise ValueError(f"{self.name}: requests must be sorted by arrival_s (use Traffic.of to sort them)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 (or None for open loop), got {self.concurrency}")

    @classmethod
    def of(cls, requests: Sequence[Request], **fields: object) -> Traffic:
        """Traffic from requests in any order (sorted by arrival, stable)."""
        return cls(tuple(sorted(requests, key=lambda r: r.arrival_s)), **fields)  # type: ignore[arg-type]

    @property
    def arrival_process(self) -> str:
        """How requests are released, in words."""
        if self.concurrency is not None:
            return f"{self.concurrency} concurrent users (closed loop)"
        span = self.requests[-1].arrival_s - self.requests[0].arrival_s
        if span == 0:
            return "all at once"
        return f"open loop, {len(self.requests) / span:.3g} requests/s on average"

    def describe(self) -> str:
        """One line: name, count, mean lengths, arrival process, source."""
        p = np.mean([r.prompt_tokens for r in self.requests])
        o = np.mean([r.output_tokens for r in self.requests])
        return (f"{self.name}: {len(self.requests)} requests, mean prompt {p:.0f} / output {o:.0f} tokens, "
                f"{self.arrival_process}" + (f" ({self.source})" if self.source else ""))


def poisson_arrivals(n: int, rate_per_s: float, *, seed: int = 0) -> np.ndarray:
    """``n`` arrival times (seconds, the first at 0) of a Poisson process at ``rate_per_s`` requests/s:
    exponential gaps, as ``vllm bench serve --request-rate`` draws them (``inf``: all at 0)."""
    if n < 1:
        raise ValueError(f"need at least one request, got n={n}")
    if not rate_per_s > 0:
        raise ValueError(f"rate must be > 0 requests/s (inf: all at once), got {rate_per_s!r}")
    if math.isinf(rate_per_s):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)
