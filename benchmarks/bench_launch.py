"""Start-up cost of sp_lab.launch: wall time to run a no-op, and a first compile, on N ranks, with ranks forked
from the warm fork server and as fresh interpreters (``SP_LAB_FORKSERVER=0``), against a bare `import torch`.

    python benchmarks/bench_launch.py                     # world sizes 1 and 2, 5 repeats each
    python benchmarks/bench_launch.py --world-sizes 2 4 --repeats 7 --json

A no-op launch is the launcher's fixed cost: start (or fork) the ranks, import torch, join the process
group, send the result back and clean up. A compiling launch adds what a rank pays before its first compile
(importing Dynamo and Inductor, Inductor's probe of the CPU) and one small compile (warm Inductor cache).
Fresh interpreters pay at least one `python -c "import torch"` per rank; forked ranks inherit the server's
imports. The two ways alternate within each repeat (fork server, fresh, fork server, ...), and the summary
gives the ratio of their medians measured in this one run. The fork server's own start (once per caller)
is paid in the untimed warm-up launch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from machine import describe, machine

import sp_lab


def noop() -> int:
    """What every rank runs: nothing but reporting its rank, so the time is all launcher."""
    return dist.get_rank()


def time_import_torch(repeats: int) -> list[float]:
    """Seconds for a fresh interpreter to import torch: the floor under any rank's start-up."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.perf_counter() - started)
    return times


def first_compile() -> int:
    """A rank's first compile: Dynamo and Inductor imported and started, one small graph (cached after once)."""
    compiled = torch.compile(lambda x: (x.sin() + 1.0).relu().sum(0), fullgraph=True)
    compiled(torch.ones(8, 8))
    return dist.get_rank()


WAYS = {"forked": "1", "fresh": "0"}  # SP_LAB_FORKSERVER


def time_launches(fn, world_size: int, repeats: int, backend: str) -> dict[str, list[float]]:
    """Seconds per ``sp_lab.launch(fn, world_size=...)`` each way, alternating, after an untimed warm-up each."""
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for repeat in range(repeats + 1):
        for way, switch in WAYS.items():
            os.environ["SP_LAB_FORKSERVER"] = switch
            started = time.perf_counter()
            result = sp_lab.launch(fn, world_size=world_size, backend=backend)
            if repeat:  # the first round warms the OS file cache, Inductor's cache and the fork server
                times[way].append(time.perf_counter() - started)
            assert result == list(range(world_size)), result
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    options = parser.parse_args()

    rows = [{"what": "python -c 'import torch'", "times_s": time_import_torch(options.repeats)}]
    for world_size in options.world_sizes:
        for fn in (noop, first_compile):
            for way, times in time_launches(fn, world_size, options.repeats, options.backend).items():
                rows.append({"what": f"launch({fn.__name__}, world_size={world_size}) {way}", "times_s": times})
    for row in rows:
        row["median_s"] = statistics.median(row["times_s"])
        row["min_s"] = min(row["times_s"])
        row["max_s"] = max(row["times_s"])
    medians = {row["what"]: row["median_s"] for row in rows}
    for row in rows:
        if row["what"].endswith(" forked"):
            row["forked_over_fresh"] = row["median_s"] / medians[row["what"].removesuffix("forked") + "fresh"]

    info = machine()
    if options.json:
        print(json.dumps({"machine": info, "backend": options.backend, "rows": rows}, indent=2))
        return
    print(
        f"machine: {describe(info)}; {options.repeats} repeats, backend={options.backend}"
    )
    print(f"{'':48s} {'median':>8s} {'min':>8s} {'max':>8s}  forked/fresh")
    for row in rows:
        ratio = f"  {row['forked_over_fresh']:.2f}x" if "forked_over_fresh" in row else ""
        print(f"{row['what']:48s} {row['median_s']:7.2f}s {row['min_s']:7.2f}s {row['max_s']:7.2f}s{ratio}")


if __name__ == "__main__":
    main()
