"""How fast the serving scheduler turns a 10,000-request trace into steps, on one core (target: under 5 s).

    python benchmarks/bench_traffic.py                 # chat workload, three arrival processes, 5 repeats
    python benchmarks/bench_traffic.py --requests 20000 --repeats 3 --json

Each case samples the named workload once, then times :func:`sp_lab.serving.scheduler.schedule` alone (the part
that runs once per policy) with a realistic step price: baseline rows of llama-3-70b at tp 8 shaped like the
predicted ones (a flat 7 ms plus 25 us per token, and the KV-cache term), so decode batches, chunked prefills and
long decode runs all occur. Light load is the hard case for a step-by-step simulator (many small steps); the
scheduler collapses repeated decode steps into runs, so its cost follows the number of events, not steps.
The process is pinned to one core where the OS allows it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from sp_lab.serving.scheduler import SchedulerLimits, StepPrice, schedule
from sp_lab.serving.workloads import workload

TARGET_S = 5.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    limits = SchedulerLimits()  # vLLM's H100/H200 server defaults: 8192 tokens, 1024 sequences
    price = StepPrice(tuple([0.0] + [7000.0 + 25.0 * t for t in range(1, limits.max_num_batched_tokens + 1)]),
                      kv_us_per_token=40960 / 4.8e6)
    cases = {"Poisson 1 req/s (light: ~3 in flight)": {"rate_per_s": 1.0},
             "Poisson 20 req/s (busy)": {"rate_per_s": 20.0},
             "64 concurrent users": {"concurrency": 64}}
    results = []
    for label, how in cases.items():
        traffic = workload(args.workload).traffic(args.requests, **how)
        times, sched = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            sched = schedule(traffic, limits, price)
            times.append(time.perf_counter() - start)
        results.append({"case": label, "requests": args.requests, "median_s": statistics.median(times),
                        "max_s": max(times), "steps": sched.num_steps, "runs": int(sched.run_steps.size),
                        "within_target": max(times) < TARGET_S})
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.workload}, {args.requests} requests, {args.repeats} repeats, one core (target < {TARGET_S:g} s):")
    for r in results:
        print(f"  {r['case']:<40} median {r['median_s']:.2f} s, max {r['max_s']:.2f} s  "
              f"({r['steps']} steps as {r['runs']} runs)  {'ok' if r['within_target'] else 'OVER TARGET'}")


if __name__ == "__main__":
    main()
