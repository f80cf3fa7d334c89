"""How long the README's test command takes from a fresh clone, and how much of the machine it had.

    python benchmarks/bench_suite.py                     # one fresh-clone `make test` of HEAD
    python benchmarks/bench_suite.py --runs 2 --json
    python benchmarks/bench_suite.py --after-run          # `make run` first (untimed), as the README and CI do

Each run clones the checkout's HEAD (committed work only, as CI sees it) into a temporary directory and runs
``CI=true make test`` there with a ``TMPDIR`` of its own, so Inductor's cache and its precompiled C++ headers start
empty as on a fresh machine; only the installed packages are reused. Reported per run: pytest's result line and
seconds, the whole command's seconds (its install step included), and the machine's CPU seconds while it ran, from
``/proc/stat``: busy, idle, and steal (time the hypervisor gave this machine's vCPUs to other guests). Before each
run the machine is watched for ten seconds with nothing of the benchmark's running: the share of its CPU time
others took then is reported too, since the project's bar is for an idle machine.

The same suite costs very different CPU time on machines that describe themselves alike (2 vCPUs of one CPU model
have needed 1.5-1.9x the CPU seconds for the same suite), so a suite's seconds mean little alone. A reference workload, timed before
and after the runs, puts a number on the machine: a fresh interpreter compiling a small model with
``torch.compile`` on empty caches (Dynamo, Inductor's code generation, g++ and its precompiled header, the kinds of
work the suite does most). A suite time from another machine compares through the ratio suite / reference.

``make test`` installs the clone in editable mode, which re-points this environment's ``sp_lab`` at the clone; an
editable install that was there before is installed again afterwards (``pip install -e --no-deps``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from machine import describe, machine

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 720.0
"""The bar the project sets for ``make test`` on an idle 2-core machine: 12 minutes."""
QUIET_S = 10.0
"""How long the machine is watched, doing nothing of the benchmark's, before each run."""

_REFERENCE = """
import time
t = time.perf_counter()
import torch
layers = [m for _ in range(4) for m in (torch.nn.Linear(96, 96), torch.nn.GELU(), torch.nn.LayerNorm(96))]
model = torch.compile(torch.nn.Sequential(*layers), dynamic=False)
with torch.no_grad():
    model(torch.randn(16, 96))
print(time.perf_counter() - t)
"""
_PYTEST_LINE = re.compile(r"^=*\s*(\d+ (?:passed|failed|error).*) in ([\d.]+)s")


@dataclass(frozen=True)
class CpuSeconds:
    """The whole machine's CPU seconds over an interval, summed over its cores (``/proc/stat``)."""

    busy: float
    steal: float
    idle: float

    @staticmethod
    def ticks() -> tuple[int, ...] | None:
        """``/proc/stat``'s machine-wide counters now, in clock ticks (user nice system idle iowait irq softirq
        steal); two readings make a :class:`CpuSeconds` through :meth:`between`."""
        try:
            with open("/proc/stat") as stat:
                return tuple(int(v) for v in stat.readline().split()[1:9])
        except OSError:  # not Linux: the figures are reported as unknown
            return None

    @classmethod
    def between(cls, before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> CpuSeconds | None:
        if before is None or after is None:
            return None
        user, nice, system, idle, iowait, irq, softirq, steal = (
            (b - a) / os.sysconf("SC_CLK_TCK") for a, b in zip(before, after))
        return cls(busy=user + nice + system + irq + softirq, steal=steal, idle=idle + iowait)


@dataclass(frozen=True)
class SuiteRun:
    """One fresh-clone ``make test``."""

    commit: str
    returncode: int
    result: str
    """pytest's summary, e.g. ``889 passed, 1 skipped, 29 warnings``."""
    pytest_s: float | None
    command_s: float
    cpu: CpuSeconds | None
    busy_before: float | None
    """The share of the machine's CPU time others used in the quiet seconds before the run (:func:`busy_share`):
    above about 0.1 the machine was not idle."""


def busy_share(seconds: float) -> float | None:
    """The share of the machine's CPU time that was busy or stolen over ``seconds`` of this process sleeping: what
    others (another job, another guest on the host) take from a run started now. None without ``/proc/stat``."""
    before = CpuSeconds.ticks()
    time.sleep(seconds)
    cpu = CpuSeconds.between(before, CpuSeconds.ticks())
    if cpu is None:
        return None
    return (cpu.busy + cpu.steal) / max(cpu.busy + cpu.steal + cpu.idle, 1e-9)


def reference_seconds() -> float:
    """One reference compile in a fresh interpreter, on empty caches (see the module's docstring)."""
    with tempfile.TemporaryDirectory(prefix="bench_suite_ref_") as scratch:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{scratch}/inductor", "TMPDIR": scratch,
               "ATEN_CPU_CAPABILITY": "default"}  # as make test sets it
        run = subprocess.run([sys.executable, "-c", _REFERENCE], env=env, check=True, stdout=subprocess.PIPE,
                             text=True)
        return float(run.stdout.strip().splitlines()[-1])


def run_suite(commit: str, log: Path, *, after_run: bool = False) -> SuiteRun:
    """Clone ``commit`` and run the README's test command there, its output to ``log``; with ``after_run``, the
    README's ``make run`` first in the same clone and temporary directory (untimed, its output to ``log`` too), so
    the suite meets the caches the main job left, as a newcomer's and CI's suite does."""
    with tempfile.TemporaryDirectory(prefix="bench_suite_") as scratch:
        clone = Path(scratch) / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", commit], check=True)
        (Path(scratch) / "tmp").mkdir()
        env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "SP_LAB_CACHE_DIR")}
        env.update(CI="true", TMPDIR=f"{scratch}/tmp")
        with log.open("w") as out:
            if after_run:
                subprocess.run(["make", "run"], check=True, cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT)
        busy_before = busy_share(QUIET_S)
        before, started = CpuSeconds.ticks(), time.perf_counter()
        with log.open("a") as out:
            returncode = subprocess.run(["make", "test"], check=False, cwd=clone, env=env, stdout=out,
                                        stderr=subprocess.STDOUT).returncode
        command_s, after = time.perf_counter() - started, CpuSeconds.ticks()
    result, pytest_s = pytest_summary(log.read_text())
    return SuiteRun(commit=commit, returncode=returncode, result=result, pytest_s=pytest_s, command_s=command_s,
                    cpu=CpuSeconds.between(before, after), busy_before=busy_before)


def pytest_summary(output: str) -> tuple[str, float | None]:
    """pytest's last result line in ``output`` without its timing, and its seconds (``"no pytest summary"``, None
    when pytest never got that far, e.g. the install step failed)."""
    found = [m for line in output.splitlines() if (m := _PYTEST_LINE.match(line.strip()))]
    return (found[-1][1], float(found[-1][2])) if found else ("no pytest summary", None)


def _installed_project() -> Path | None:
    """The project directory this environment's ``sp_lab`` is imported from (an editable install's checkout), or
    None where it is missing or a regular install."""
    found = subprocess.run([sys.executable, "-c", "import sp_lab; print(sp_lab.__file__)"], check=False,
                           cwd=tempfile.gettempdir(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if found.returncode != 0:
        return None
    project = Path(found.stdout.strip()).resolve().parents[1]
    return project if (project / "pyproject.toml").is_file() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="fresh-clone runs of make test, one after the other")
    parser.add_argument("--commit", default="HEAD", help="what to clone and test (a commit, branch or tag)")
    parser.add_argument("--references", type=int, default=2,
                        help="reference compiles before and after the runs (their median is reported)")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "bench_suite_logs",
                        help="folder for each run's make test output")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--after-run", action="store_true",
                        help="run `make run` in each clone first (untimed), as the README's order and CI do")
    args = parser.parse_args()
    if args.runs < 1 or args.references < 1:
        parser.error(f"--runs and --references must be at least 1, got {args.runs} and {args.references}")
    resolved = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.commit], check=False,
                              capture_output=True, text=True)
    if resolved.returncode != 0:
        parser.error(f"--commit {args.commit!r} is not a commit of {ROOT}: {resolved.stderr.strip()}")
    commit = resolved.stdout.strip()
    args.logs.mkdir(parents=True, exist_ok=True)
    installed = _installed_project()

    references = [reference_seconds() for _ in range(args.references)]
    runs = []
    try:
        for i in range(args.runs):
            runs.append(run_suite(commit, args.logs / f"make_test_{commit}_{i + 1}.log", after_run=args.after_run))
            print(f"run {i + 1}: {runs[-1].result}, pytest {runs[-1].pytest_s} s, make test {runs[-1].command_s:.1f} s",
                  file=sys.stderr)
    finally:
        if installed is not None and installed.is_dir() and _installed_project() != installed:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-e", str(installed)],
                           check=True)
    references += [reference_seconds() for _ in range(args.references)]

    reference_s = statistics.median(references)
    result = {
        "machine": machine(),
        "measured": {"kind": "measured", "command": ("CI=true make test, fresh clone, after make run" if args.after_run
                                 else "CI=true make test, fresh clone, empty caches"), "commit": commit,
                     "target_s": TARGET_S},
        "reference_s": references,
        "runs": [{**asdict(run), "command_over_reference": run.command_s / reference_s} for run in runs],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"make test of {commit} from a fresh clone on {describe(result['machine'])}")
    print(f"reference compile: median {reference_s:.1f} s of {len(references)} "
          f"({min(references):.1f}-{max(references):.1f} s, half before the runs, half after)")
    for i, run in enumerate(runs, 1):
        verdict = "within" if run.returncode == 0 and run.command_s <= TARGET_S else "NOT within"
        cpu = (f"busy {run.cpu.busy:.0f} core-s, steal {run.cpu.steal:.0f}, idle {run.cpu.idle:.0f}"
               if run.cpu else "CPU seconds unknown (no /proc/stat)")
        idle = ("" if run.busy_before is None else f"; {run.busy_before:.0%} busy before the run"
                + (" (not idle)" if run.busy_before >= 0.1 else " (idle)"))
        print(f"  run {i}: {run.result}; pytest {run.pytest_s} s, make test {run.command_s:.1f} s "
              f"= {run.command_s / reference_s:.0f} references, {verdict} {TARGET_S:.0f} s; {cpu}{idle}")


if __name__ == "__main__":
    main()
