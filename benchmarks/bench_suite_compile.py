"""What the test suite's CPU setting buys: the cold compiles of test modules' rank checks with the machine's own
vector instructions and with plain C++ kernels (``ATEN_CPU_CAPABILITY=default``, which ``make test`` sets).

    python benchmarks/bench_suite_compile.py                                  # test_compiler_backend, 2 pairs
    python benchmarks/bench_suite_compile.py --modules test_token_dim test_compiler_backend --pairs 3 --json

Each run is a fresh interpreter that runs the registered rank checks of ``--modules`` (``tests/rank_checks.py``)
on 2 gloo ranks, as the suite's shared launch does, with an empty Inductor cache of its own and sp_lab's artifact
cache off, so every kernel is generated and compiled. The two settings alternate (native, plain, native, ...,
the first of each pair rotating), and the summary gives each pair's ratio plain / native and their median, and
each module's seconds (the slower rank's) under each setting: figures from one run on one machine, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import describe, machine

TESTS = Path(__file__).resolve().parents[1] / "tests"
SETTINGS = {"native": None, "plain": "default"}  # ATEN_CPU_CAPABILITY
_RUN = """
import importlib, json, sys
sys.path.insert(0, {tests!r})
import rank_checks
for module in {modules!r}:
    importlib.import_module(module)
per_rank = rank_checks.launch_for({modules!r})
print(json.dumps({{m: max(r[m].seconds for r in per_rank) for m in per_rank[0]}}))
"""


def time_one(modules: list[str], capability: str | None) -> tuple[float, dict[str, float]]:
    """One cold run of the rank checks of ``modules`` under ``capability``: its wall seconds (interpreter start,
    launch and checks) and each module's checks' seconds (the slower rank's)."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    with tempfile.TemporaryDirectory(prefix="bench_suite_compile_") as cache:
        env.update(TORCHINDUCTOR_CACHE_DIR=cache, SP_LAB_CACHE_DIR="off")
        started = time.perf_counter()
        run = subprocess.run([sys.executable, "-c", _RUN.format(tests=str(TESTS), modules=modules)], env=env,
                             check=True, stdout=subprocess.PIPE, text=True)
        return time.perf_counter() - started, json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", nargs="+", default=["test_compiler_backend"], help="test modules with rank checks")
    parser.add_argument("--pairs", type=int, default=2, help="native/plain pairs, the first of each rotating")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    missing = [m for m in args.modules if not (TESTS / f"{m}.py").is_file()]
    if missing:
        parser.error(f"no such test module under {TESTS}: {missing} (e.g. test_token_dim, test_compiler_backend)")

    pairs = []
    for i in range(args.pairs):
        order = list(SETTINGS) if i % 2 == 0 else list(reversed(SETTINGS))
        runs = {name: time_one(args.modules, SETTINGS[name]) for name in order}
        seconds = {name: wall for name, (wall, _) in runs.items()}
        pairs.append({**seconds, "plain_over_native": seconds["plain"] / seconds["native"],
                      "modules_s": {name: per_module for name, (_, per_module) in runs.items()}})
        print(f"pair {i + 1}: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
              + f", plain / native {pairs[-1]['plain_over_native']:.3f}", file=sys.stderr)
    result = {
        "machine": machine(),
        "measured": {"modules": args.modules, "kind": "measured, cold, 2 gloo ranks"},
        "pairs": pairs,
        "median_plain_over_native": statistics.median(p["plain_over_native"] for p in pairs),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{', '.join(args.modules)} on {describe(result['machine'])}: "
              f"plain C++ kernels take {result['median_plain_over_native']:.2f}x the native ones' time "
              f"(median of {len(pairs)} pairs)")
        for module in args.modules:
            print(f"  {module}: " + ", ".join(
                f"{name} {statistics.median(p['modules_s'][name][module] for p in pairs):.1f} s" for name in SETTINGS))


if __name__ == "__main__":
    main()
