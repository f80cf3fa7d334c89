"""Named synthetic workloads: prompt and output lengths with the public source of their statistics.

Published datasets give mean lengths; the spread around them is our assumption (a log-normal, the usual shape
of text lengths, with the ``sigma`` written beside each), and every sampled length is clipped to
``[1, max_model_len]`` with prompt + output within the model's context. The names, their means and sources:

- ``chat``: ShareGPT conversations as the vLLM paper used them (Kwon et al., SOSP 2023, section 6: mean input
  161 and output 338 tokens);
- ``lmsys-chat``: LMSYS-Chat-1M (Zheng et al., 2023, table 1: 69.5 tokens per prompt, 214.5 per response);
- ``summarization``: arXiv papers to abstracts (Cohan et al., NAACL 2018: documents of 4,938 words, abstracts of
  220 words on average; 1.3 tokens per word assumed) -- long prompts, short outputs;
- ``decode-heavy``: short prompts, long answers (reasoning-style traffic). Illustrative: no public dataset is
  named for its means (200 in, 1,500 out);
- ``random``: ``vllm bench serve --dataset-name random`` with its defaults, exactly 1,024 tokens in and 128 out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sp_lab.serving.traffic import Request, Traffic, poisson_arrivals

__all__ = ["WORKLOADS", "Lengths", "Workload", "workload", "workload_names"]


@dataclass(frozen=True)
class Lengths:
    """A length distribution in tokens: log-normal with this mean (``sigma=0``: always ``mean``)."""

    mean: float
    """Mean tokens (from the source)."""
    sigma: float = 0.0
    """Standard deviation of the log of the length (our assumption; 0 = fixed length)."""

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` integer lengths >= 1."""
        if self.sigma == 0:
            return np.full(n, max(1, round(self.mean)), dtype=np.int64)
        mu = math.log(self.mean) - self.sigma ** 2 / 2  # so that the log-normal's mean is ``mean``
        return np.maximum(1, np.rint(rng.lognormal(mu, self.sigma, size=n))).astype(np.int64)


@dataclass(frozen=True)
class Workload:
    """A named workload: prompt and output lengths and where their statistics come from."""

    name: str
    """How the CLI and the notebook name it."""
    prompt: Lengths
    """Prompt tokens."""
    output: Lengths
    """Output tokens."""
    source: str
    """The public source of the means (and what is assumed)."""

    def traffic(self, n: int = 1000, *, rate_per_s: float | None = None, concurrency: int | None = None,
                max_model_len: int | None = None, seed: int = 0) -> Traffic:
        """``n`` requests of this workload, sent at ``rate_per_s`` (Poisson; ``inf``: all at once) and/or with at
        most ``concurrency`` in flight (closed loop; requests then start at 0 unless a rate is given too).

        ``max_model_len`` (the model's context): prompts are clipped to leave room for at least one output
        token, outputs to what is left. One of ``rate_per_s`` / ``concurrency`` is required.
        """
        if rate_per_s is None and concurrency is None:
            raise ValueError("give a request rate (rate_per_s, Poisson) or a concurrency (concurrent users), or both")
        rng = np.random.default_rng(seed)
        prompts = self.prompt.sample(n, rng)
        outputs = self.output.sample(n, rng)
        if max_model_len is not None:
            if max_model_len < 2:
                raise ValueError(f"max_model_len must be >= 2 (a prompt token and an output token), got {max_model_len}")
            prompts = np.minimum(prompts, max_model_len - 1)
            outputs = np.minimum(outputs, max_model_len - prompts)
        arrivals = poisson_arrivals(n, rate_per_s if rate_per_s is not None else math.inf, seed=seed + 1)
        requests = tuple(Request(float(a), int(p), int(o)) for a, p, o in zip(arrivals, prompts, outputs, strict=True))
        how = [f"Poisson {rate_per_s:g}/s" if rate_per_s is not None and math.isfinite(rate_per_s) else "",
               f"{concurrency} concurrent" if concurrency is not None else ""]
        return Traffic(requests, concurrency=concurrency, name=self.name,
                       source=f"{self.source}; {', '.join(h for h in how if h)}, seed {seed}")


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("chat", Lengths(161, 1.0), Lengths(338, 0.9),
             "ShareGPT means from the vLLM paper (Kwon et al., SOSP 2023); log-normal spread assumed (sigma 1.0 / 0.9)"),
    Workload("lmsys-chat", Lengths(69.5, 1.0), Lengths(214.5, 0.9),
             "LMSYS-Chat-1M means (Zheng et al., 2023); log-normal spread assumed (sigma 1.0 / 0.9)"),
    Workload("summarization", Lengths(4938 * 1.3, 0.5), Lengths(220 * 1.3, 0.5),
             "arXiv summarization means (Cohan et al., NAACL 2018), 1.3 tokens per word assumed; "
             "log-normal spread assumed (sigma 0.5)"),
    Workload("decode-heavy", Lengths(200, 0.6), Lengths(1500, 0.6),
             "illustrative short prompts and long answers (no public dataset); log-normal spread assumed (sigma 0.6)"),
    Workload("random", Lengths(1024), Lengths(128),
             "vllm bench serve --dataset-name random defaults: 1024 tokens in, 128 out, fixed"),
)}
"""The named workloads (see the module docstring)."""


def workload_names() -> list[str]:
    """The names :func:`workload` accepts."""
    return list(WORKLOADS)


def workload(name: str) -> Workload:
    """The named workload; ``ValueError`` listing the names for an unknown one."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)} "
                         "(or pass your own trace file)")
    return WORKLOADS[name]
