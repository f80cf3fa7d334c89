"""A model of vLLM v1's continuous batching with chunked prefill: traffic in, steps out.

Each step (one forward pass of the model over a batch of tokens) is built as vLLM v1's scheduler builds it
(``vllm/v1/core/sched/scheduler.py``; the vLLM paper, Kwon et al. SOSP 2023; Sarathi-Serve, Agrawal et al. OSDI
2024, for chunked prefill), from a token budget ``max_num_batched_tokens`` and a cap ``max_num_seqs`` on requests
in flight:

1. every running request in its decode phase advances by one token (decodes first: vLLM requires
   ``max_num_batched_tokens >= max_num_seqs``, so they always fit);
2. a running request still prefilling (a prompt cut by the budget last step) continues with as many prompt
   tokens as the budget has left;
3. waiting requests are admitted first come first served while budget is left and fewer than
   ``max_num_seqs`` run, each taking ``min(prompt left, budget left)`` tokens (the last one admitted may be cut:
   its prompt is chunked).

A request arriving while a step runs is scheduled from the next step. The step that finishes a prompt yields the
request's first token; each later step yields one more. Left out, on purpose: KV-cache capacity and preemption
(memory is assumed to suffice), prefix caching, speculative decoding, the per-request long-prefill cap, and host
time between steps (vLLM overlaps scheduling with the GPU).

Stretches where nothing but the same decodes run are recorded as one *run* of identical steps (the time of each
step still grows with the context the decodes read), so 10,000 requests schedule in well under a second whatever
the load (``benchmarks/bench_traffic.py``).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sp_lab.serving.traffic import Traffic

__all__ = ["Schedule", "SchedulerLimits", "Step", "StepPrice", "replay_steps", "schedule"]


@dataclass(frozen=True)
class SchedulerLimits:
    """The scheduler's two limits. Defaults: vLLM's for its OpenAI server on GPUs with at least 70 GiB (H100,
    H200): ``max_num_batched_tokens=8192``, ``max_num_seqs=1024`` (``EngineArgs.get_batch_defaults``)."""

    max_num_batched_tokens: int = 8192
    """Tokens per step, decodes and prefill chunks together."""
    max_num_seqs: int = 1024
    """Requests in flight (decoding or prefilling)."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens and max_num_seqs must be >= 1, got "
                             f"{self.max_num_batched_tokens} and {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_num_seqs={self.max_num_seqs}: vLLM "
                "refuses this too (a step must fit one decode token per request); raise the budget or lower "
                "max_num_seqs")


@dataclass(frozen=True)
class StepPrice:
    """What a step costs: a table by the step's token count, plus a term per context token its decodes read."""

    by_tokens_us: tuple[float, ...]
    """Microseconds of a step of ``T`` tokens at index ``T`` (index 0 unused); covers ``1..max_num_batched_tokens``."""
    kv_us_per_token: float = 0.0
    """Microseconds per context token a decode reads from the KV cache (0: not modelled)."""

    @classmethod
    def flat(cls, max_tokens: int, us: float = 1.0) -> StepPrice:
        """Every step costs ``us`` (hand-computed schedules in tests, step counting)."""
        return cls((0.0,) + (float(us),) * max_tokens)

    def step_us(self, tokens: int, kv_tokens: int = 0) -> float:
        """One step of ``tokens`` whose decodes read ``kv_tokens`` context tokens."""
        return self.by_tokens_us[tokens] + self.kv_us_per_token * kv_tokens


@dataclass(frozen=True)
class Step:
    """One step, spelled out (:meth:`Schedule.steps`)."""

    number: int
    """1-based."""
    tokens: int
    """Tokens in the batch."""
    decodes: tuple[int, ...]
    """Requests (indices into the traffic) that advance by one decode token."""
    prefills: tuple[tuple[int, int], ...]
    """``(request, prompt tokens)`` chunks, in the order they were scheduled."""


@dataclass(frozen=True)
class Schedule:
    """The steps a traffic ran as, and when each request got its first and last token.

    Steps are stored as runs of identical steps (``run_*`` arrays, one entry per run); per-request arrays are
    indexed like the traffic's requests (empty for a replayed step list).
    """

    limits: SchedulerLimits | None
    """The limits it was scheduled under (``None``: a recorded step list)."""
    run_tokens: np.ndarray
    """Tokens per step of each run."""
    run_steps: np.ndarray
    """Steps in each run."""
    run_decodes: np.ndarray
    """Decode tokens per step of each run (the rest are prompt tokens)."""
    run_start_s: np.ndarray
    """When each run starts (seconds)."""
    run_time_s: np.ndarray
    """Seconds all steps of each run take together."""
    run_kv_tokens: np.ndarray
    """Context tokens the run's decodes read, over all its steps."""
    arrival_s: np.ndarray
    """When each request was sent (under a concurrency cap: when a slot freed)."""
    first_token_s: np.ndarray
    """End of the step that finished its prompt."""
    finish_s: np.ndarray
    """End of the step that produced its last token."""
    first_token_step: np.ndarray
    """1-based number of that step."""
    finish_step: np.ndarray
    """1-based number of the last token's step."""
    output_tokens: np.ndarray
    """Tokens each request generated."""
    prefill_chunks: tuple[tuple[int, int, int], ...]
    """``(step, request, tokens)`` for every prompt chunk."""

    @property
    def num_steps(self) -> int:
        """Steps in all."""
        return int(self.run_steps.sum())

    @property
    def busy_s(self) -> float:
        """Seconds spent in steps (the GPUs' busy time)."""
        return float(self.run_time_s.sum())

    @property
    def span_s(self) -> float:
        """From the first arrival (or the first step) to the end of the last step."""
        start = float(self.arrival_s.min()) if self.arrival_s.size else float(self.run_start_s[0])
        return float(self.run_start_s[-1] + self.run_time_s[-1]) - start

    def step_tokens(self) -> np.ndarray:
        """Token count of every step, in order."""
        return np.repeat(self.run_tokens, self.run_steps)

    def ttft_s(self) -> np.ndarray:
        """Time to first token of each request (from when it was sent)."""
        return self.first_token_s - self.arrival_s

    def tpot_s(self) -> np.ndarray:
        """Time per output token after the first, for requests with at least two output tokens."""
        many = self.output_tokens > 1
        return (self.finish_s[many] - self.first_token_s[many]) / (self.output_tokens[many] - 1)

    def steps(self) -> list[Step]:
        """Every step spelled out: which requests advance and by how much. For small schedules (tests, reading)."""
        chunks: dict[int, list[tuple[int, int]]] = {}
        for step, request, tokens in self.prefill_chunks:
            chunks.setdefault(step, []).append((request, tokens))
        out = []
        for number, tokens in enumerate(self.step_tokens().tolist(), start=1):
            # a request decodes in the steps after the one that gave its first token, up to its last token's
            decodes = np.flatnonzero((self.first_token_step < number) & (number <= self.finish_step))
            out.append(Step(number, int(tokens), tuple(int(i) for i in decodes), tuple(chunks.get(number, ()))))
        return out


def _check_price(price: StepPrice, max_tokens: int) -> None:
    if len(price.by_tokens_us) <= max_tokens:
        raise ValueError(f"the step price covers 1..{len(price.by_tokens_us) - 1} tokens but steps may take up to "
                         f"{max_tokens}: price every count up to max_num_batched_tokens")


def schedule(traffic: Traffic, limits: SchedulerLimits, price: StepPrice) -> Schedule:
    """Run ``traffic`` through the scheduler (module docstring), each step taking ``price`` of its tokens.

    The step times feed back: requests that arrive while a long step runs wait for the next one, so each policy
    gets its own schedule of the same traffic.
    """
    _check_price(price, limits.max_num_batched_tokens)
    budget_max, max_seqs = limits.max_num_batched_tokens, limits.max_num_seqs
    table = [us * 1e-6 for us in price.by_tokens_us]
    per_kv = price.kv_us_per_token * 1e-6
    n = len(traffic.requests)
    prompt = [r.prompt_tokens for r in traffic.requests]
    output = [r.output_tokens for r in traffic.requests]
    nominal = [r.arrival_s for r in traffic.requests]
    arrival = list(nominal)
    first_s, finish_s = [np.nan] * n, [np.nan] * n
    first_step, finish_step = [0] * n, [0] * n
    released = n if traffic.concurrency is None else min(traffic.concurrency, n)
    pending = deque(range(released))  # sent, not yet arrived at the scheduler (arrival times never decrease)
    waiting: deque[int] = deque()
    prefilling: deque[list[int]] = deque()  # [request, prompt tokens left], in admission order
    decoding: list[tuple[int, int]] = []  # heap of (step number of its last token, request)
    runs: list[tuple[int, int, int, float, float, float]] = []  # tokens, steps, decodes, start, seconds, kv
    chunks: list[tuple[int, int, int]] = []
    kv = 0  # context tokens of the decoding requests (what the next decode step reads)
    done = 0  # steps completed
    now = 0.0
    finished = 0

    def finish(i: int) -> None:
        nonlocal kv, finished, released
        finish_s[i], finish_step[i] = now, done
        finished += 1
        if traffic.concurrency is not None and released < n:  # a user whose answer came back sends the next one
            arrival[released] = max(nominal[released], now)
            pending.append(released)
            released += 1

    while finished < n:
        while pending and arrival[pending[0]] <= now:
            waiting.append(pending.popleft())
        n_decode = len(decoding)
        running = n_decode + len(prefilling)
        if not prefilling and (not waiting or running >= max_seqs):
            if n_decode == 0:  # idle until the next request arrives
                now = max(now, arrival[pending[0]])
                continue
            # Only the same decodes run until the next one finishes or a request can be admitted: one run.
            c, d = table[n_decode], n_decode

            def run_s(k: int, c: float = c, d: int = d, kv0: int = kv) -> float:
                return k * c + per_kv * (k * kv0 + d * k * (k - 1) / 2)

            k = decoding[0][0] - done
            if not waiting and pending and running < max_seqs and now + run_s(k) > arrival[pending[0]]:
                lo, hi = 1, k  # the first step that ends at or after the arrival: it is admitted after that step
                target = arrival[pending[0]] - now
                while lo < hi:
                    mid = (lo + hi) // 2
                    if run_s(mid) >= target:
                        hi = mid
                    else:
                        lo = mid + 1
                k = lo
            seconds = run_s(k)
            runs.append((d, k, d, now, seconds, k * kv + d * k * (k - 1) / 2))
            now += seconds
            done += k
            kv += d * k
            while decoding and decoding[0][0] == done:
                _, i = heapq.heappop(decoding)
                kv -= prompt[i] + output[i]
                finish(i)
            continue
        # A mixed step: decodes, then the prompt being chunked, then new requests while budget and seats last.
        budget = budget_max - n_decode
        step_no = done + 1
        for entry in prefilling:
            if budget == 0:
                break
            take = min(entry[1], budget)
            entry[1] -= take
            budget -= take
            chunks.append((step_no, entry[0], take))
        while waiting and budget > 0 and running < max_seqs:
            i = waiting.popleft()
            take = min(prompt[i], budget)
            budget -= take
            running += 1
            prefilling.append([i, prompt[i] - take])
            chunks.append((step_no, i, take))
        tokens = budget_max - budget
        seconds = table[tokens] + per_kv * kv
        runs.append((tokens, 1, n_decode, now, seconds, kv))
        now += seconds
        done = step_no
        kv += n_decode
        while decoding and decoding[0][0] == done:
            _, i = heapq.heappop(decoding)
            kv -= prompt[i] + output[i]
            finish(i)
        while prefilling and prefilling[0][1] == 0:
            i = prefilling.popleft()[0]
            first_s[i], first_step[i] = now, done
            if output[i] == 1:
                finish(i)
            else:
                heapq.heappush(decoding, (done + output[i] - 1, i))
                kv += prompt[i] + 1
    r = np.array(runs, dtype=float).reshape(-1, 6)
    return Schedule(
        limits=limits, run_tokens=r[:, 0].astype(np.int64), run_steps=r[:, 1].astype(np.int64),
        run_decodes=r[:, 2].astype(np.int64), run_start_s=r[:, 3], run_time_s=r[:, 4], run_kv_tokens=r[:, 5],
        arrival_s=np.array(arrival), first_token_s=np.array(first_s), finish_s=np.array(finish_s),
        first_token_step=np.array(first_step, dtype=np.int64), finish_step=np.array(finish_step, dtype=np.int64),
        output_tokens=np.array(output, dtype=np.int64), prefill_chunks=tuple(chunks))


def replay_steps(step_tokens: Sequence[int], price: StepPrice) -> Schedule:
    """A recorded list of per-step token counts priced as steps (no requests: no TTFT / TPOT; the KV term is
    unknown and left out)."""
    tokens = np.asarray(step_tokens, dtype=np.int64)
    if tokens.size == 0:
        raise ValueError("the step list is empty")
    _check_price(price, int(tokens.max()))
    table = np.asarray(price.by_tokens_us) * 1e-6
    seconds = table[tokens]
    empty_f, empty_i = np.empty(0), np.empty(0, dtype=np.int64)
    return Schedule(limits=None, run_tokens=tokens, run_steps=np.ones_like(tokens), run_decodes=np.zeros_like(tokens),
                    run_start_s=np.concatenate([[0.0], np.cumsum(seconds)[:-1]]), run_time_s=seconds,
                    run_kv_tokens=np.zeros(tokens.size), arrival_s=empty_f, first_token_s=empty_f, finish_s=empty_f,
                    first_token_step=empty_i, finish_step=empty_i, output_tokens=empty_i, prefill_chunks=())
