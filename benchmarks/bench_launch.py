"""Start-up cost of sp_lab.launch: wall time to run a no-op on N ranks, against a bare `import torch`.

    python benchmarks/bench_launch.py                     # world sizes 1 and 2, 5 repeats each
    python benchmarks/bench_launch.py --world-sizes 2 4 --repeats 7 --json

A no-op launch is the launcher's fixed cost: start the interpreters, import torch, join the process
group, send the result back and clean up. The floor is one `python -c "import torch"`, since every
rank pays that; on a machine with fewer cores than ranks, the ranks' imports also compete for CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

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


def time_launch(world_size: int, repeats: int, backend: str) -> list[float]:
    """Seconds per ``sp_lab.launch(noop, world_size=...)``, after one untimed warm-up launch."""
    sp_lab.launch(noop, world_size=world_size, backend=backend)  # warm the OS file cache
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = sp_lab.launch(noop, world_size=world_size, backend=backend)
        times.append(time.perf_counter() - started)
        assert result == list(range(world_size)), result
    return times


def machine() -> dict:
    """Where the figures come from."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gpus": gpus,
        "gpu_name": torch.cuda.get_device_name(0) if gpus else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


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
        rows.append(
            {
                "what": f"launch(noop, world_size={world_size})",
                "times_s": time_launch(world_size, options.repeats, options.backend),
            }
        )
    for row in rows:
        row["median_s"] = statistics.median(row["times_s"])
        row["min_s"] = min(row["times_s"])
        row["max_s"] = max(row["times_s"])

    info = machine()
    if options.json:
        print(json.dumps({"machine": info, "backend": options.backend, "rows": rows}, indent=2))
        return
    print(
        f"machine: {info['cores']} cores ({info['cpu']}), {info['gpus']} GPU(s)"
        f"{' ' + info['gpu_name'] if info['gpu_name'] else ''}; python {info['python']}, "
        f"torch {info['torch']}; {options.repeats} repeats, backend={options.backend}"
    )
    print(f"{'':36s} {'median':>8s} {'min':>8s} {'max':>8s}")
    for row in rows:
        print(f"{row['what']:36s} {row['median_s']:7.2f}s {row['min_s']:7.2f}s {row['max_s']:7.2f}s")


if __name__ == "__main__":
    main()
