"""Serving-level answers: does SP + AsyncTP pay on *this* traffic, not only at one token count?

A serving engine never runs one token count: under continuous batching most steps are small decode batches and a
few are large prefill chunks, and users judge it by time to first token (TTFT) and time per output token (TPOT).
This package turns traffic into the steps a vLLM-style scheduler would run, prices every step from the latency
rows of each policy, and reports what the traffic would cost under each:

- :mod:`.traffic`: a request (arrival, prompt and output tokens), arrival processes (Poisson at a rate; a fixed
  number of concurrent users, as ``vllm bench serve --max-concurrency``) and the :class:`~.traffic.Traffic` record;
- :mod:`.workloads`: named synthetic workloads (prompt / output lengths with their public sources);
- :mod:`.traces`: the user's request trace (CSV, JSONL, parquet) and recorded per-step token counts;
- :mod:`.scheduler`: a model of vLLM v1's continuous batching with chunked prefill (token budget, sequence cap,
  running decodes first, prefills chunked into the rest, first come first served);
- :mod:`.step_costs`: step latency per variant from latency rows (measured, else predicted; never mixed);
- :mod:`.policies`: the policies compared (baseline, SP, SP + AsyncTP from a threshold, the per-matmul rule, a
  tuned config), each a program per token count from :mod:`sp_lab.programs`;
- :mod:`.verdict`: the report (step-size histogram, total time, throughput, TTFT / TPOT percentiles, the saving
  against baseline with its interval, the traffic-weighted threshold, one sentence).
- :mod:`.on_rows`: a workload priced on a sweep's own rows (budget: the largest count they cover), shared by the HTML
  report, the exported config's ``serving`` section and the tuner's traffic-weighted regret.

Background, the scheduler's rules and their sources: ``docs/serving.md``.
"""
