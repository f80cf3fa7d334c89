"""Mutation score of the fast modules: how many small planted bugs their fast tests catch, per module (mutmut).

    pip install "mutmut==3.8.1"                          # not in the dev extra: it pulls textual and its TUI stack
    nice -n 10 python benchmarks/bench_mutation.py       # every module below, one after the other
    python benchmarks/bench_mutation.py paths policy --timeout 900 --show-survivors

mutmut (https://mutmut.readthedocs.io) rewrites each function of a module many ways (``<`` for ``<=``, another
constant, a dropped argument, ...) and runs the tests that reach the function against each rewrite ("mutant"):
a mutant no test fails on *survived*. The score is (killed + timed out) / mutants; a mutant of a function that
no selected test calls counts against it ("no tests"). Survivors are either equivalent (no behaviour changes)
or a test missing: the README's testing section lists the figures and judges the survivors.

Each module runs with its own fast test files only (``TARGETS``; no launch, no compile), so a score says what
those files guard, and the run takes minutes, not hours. Where a module is mostly compiler machinery, only its
key functions are mutated (``functions``: the capture's call signature, the artifact cache's key), with the
tests that check them field by field. Everything happens in copies of the checkout, one per module (under
``--workdir``, default a temporary directory): mutmut writes its ``mutants/`` tree there, never in the working
tree. One pytest process, no pytest-xdist (mutmut forks it per mutant).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Target:
    """One module to mutate, the fast test files that guard it and, optionally, the only functions to mutate
    (fnmatch patterns over mutmut's names: ``call_signature``, ``SharedCaptures*find`` for a method)."""

    module: str
    tests: tuple[str, ...]
    functions: tuple[str, ...] = ()
    deselect: tuple[str, ...] = ()
    """Tests of those files left out: ones that launch ranks (minutes per mutant) or cannot run instrumented."""
    pasted: tuple[str, ...] = ()
    """Functions whose source the module pastes into code it generates (``inspect.getsource``): mutmut's wrapper
    around them would be pasted too, so the copy marks them ``# pragma: no mutate block`` (not mutated)."""


# The compiled-model tests of test_cache_keys run Dynamo, and capture() clones the code object of ``_entry``, which
# mutmut's instrumentation of capture.py replaces: they run in the suite, not under mutation of that file.
_RUNS_DYNAMO = ("test_a_variant_never_runs_another_variants_capture_whose_guards_fail",
                "test_one_compiled_model_called_in_two_dtypes_answers_in_each")
# The exported torch.compile snippet compiled under a fake group: the export is guarded by the other tests there.
_COMPILES_SNIPPET = "test_torch_compile_snippet_fuses_from_the_tuned_count_on_the_registered_group"

# A warning's stacklevel counts frames, and mutmut's trampoline around each mutated function adds one.
_WARNS_AT_CALLER = "tests/test_policy.py::test_the_fusion_warning_points_at_the_caller"

TARGETS = {
    "paths": Target("sp_lab/paths.py", ("tests/test_paths.py",)),
    "config": Target("sp_lab/config.py", ("tests/test_config.py", "tests/test_config_values.py"),
                     deselect=("tests/test_config.py::test_effective_gloo_two_ranks",)),
    "policy": Target("sp_lab/tuning/policy.py", ("tests/test_policy.py",), deselect=(_WARNS_AT_CALLER,)),
    # traffic_regret is tested by the serving verdict's tests (less their 9 s prediction of a 7B model);
    # test_serving_on_rows (the tuner's weighted regret, 1-8 s a test) would triple the time of every mutant
    "regret": Target("sp_lab/tuning/regret.py", ("tests/test_policy.py", "tests/test_serving_verdict.py"),
                     deselect=("tests/test_serving_verdict.py::test_predicted_rows_are_the_rows_the_predict_command_prints",
                               _WARNS_AT_CALLER)),
    "model_sp": Target("sp_lab/tuning/model_sp.py", ("tests/test_model_sp.py", "tests/test_model_sp_file.py"),
                       pasted=("operand_dtype", "whole_batch")),
    "capture_keys": Target("sp_lab/compiler/capture.py", ("tests/test_cache_keys.py",),
                           ("call_signature", "_tensor_key", "_value_key", "_Identity*", "SharedCaptures*"),
                           deselect=tuple(f"tests/test_cache_keys.py::{test}" for test in _RUNS_DYNAMO)),
    "cache_keys": Target("sp_lab/compiler/artifact_cache.py", ("tests/test_cache_keys.py",),
                         ("range_key", "_input_key", "cache_dir")),
    # test_serving_on_rows (a serving answer priced behind each export: ~10 s a mutant, hours for the module) is
    # left out, so what only it reaches (the serving answer's rows-hash refusal) counts against the score here.
    "export": Target("sp_lab/tuning/export.py", ("tests/test_config.py", "tests/test_model_sp.py",
                                                "tests/test_exports_applied.py", "tests/test_vllm_releases.py",
                                                "tests/test_export_file.py", "tests/test_export_description.py",
                                                "tests/test_export_provenance.py"),
                     deselect=("tests/test_config.py::test_effective_gloo_two_ranks",
                               f"tests/test_exports_applied.py::{_COMPILES_SNIPPET}")),
    "crossover": Target("sp_lab/tuning/predict/crossover.py", ("tests/test_crossover.py",)),
}

KILLED = ("killed", "timeout")
STATUS_LINE = re.compile(r"^\s*(\S+): (.+)$")


@dataclass
class Score:
    """One module's run: mutants by status, the score, the survivors' names, the seconds it took."""

    name: str
    module: str
    tests: list[str]
    statuses: dict[str, int] = field(default_factory=dict)
    survivors: list[str] = field(default_factory=list)
    diffs: dict[str, str] = field(default_factory=dict)
    """Each survivor's change (``mutmut show``), to judge it: equivalent, or a test missing."""
    seconds: float = 0.0
    complete: bool = True
    error: str | None = None
    """Why mutmut did not run (its output's tail), if it did not."""

    @property
    def mutants(self) -> int:
        return sum(n for status, n in self.statuses.items() if status != "not checked")

    @property
    def score(self) -> float | None:
        killed = sum(self.statuses.get(s, 0) for s in KILLED)
        return killed / self.mutants if self.mutants else None


def copy_checkout(workdir: Path) -> None:
    """The files git knows (tracked, and untracked not ignored) of the code and its tests, into ``workdir``."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.splitlines()
    for name in listed:
        if name.split("/")[0] not in ("sp_lab", "tests", "data", "pyproject.toml", "setup.py"):
            continue
        source = ROOT / name
        if source.is_file():
            (workdir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, workdir / name)


def configure(workdir: Path, target: Target) -> None:
    """The copy's ``pyproject.toml`` with a ``[tool.mutmut]`` table for ``target`` (any earlier one replaced)."""
    path = workdir / "pyproject.toml"
    text = path.read_text().split("\n[tool.mutmut]\n")[0]
    table = {
        "source_paths": ["sp_lab/"],
        "only_mutate": [target.module],
        "also_copy": ["data/"],  # the presets and tables sp_lab.resources finds beside sp_lab/
        "pytest_add_cli_args_test_selection": list(target.tests),
        # Each mutant's pytest is forked from a server that imported the tests but ran none: forked from a process
        # that ran them (mutmut's default), a child inherits locks of torch's and polars' thread pools held by
        # threads that do not exist in it, and hangs until mutmut's timeout.
        "process_isolation": "forkserver",
        # A mutant's limit is 15x its tests' own time plus this: a forked pytest still starts and collects (seconds
        # on a loaded 2-core machine), which the default 1 s does not cover (every mutant would time out).
        "timeout_constant": 20.0,
        "pytest_add_cli_args": ["-q", "-p", "no:randomly", "-p", "no:xdist", "-p", "no:cacheprovider",
                                *(arg for test in target.deselect for arg in ("--deselect", test))],
    }
    lines = [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    path.write_text(text.rstrip("\n") + "\n\n[tool.mutmut]\n" + "\n".join(lines) + "\n")


def mutant_globs(target: Target) -> list[str]:
    dotted = target.module.removesuffix(".py").replace("/", ".")
    return [f"{dotted}.x*{fn}__mutmut_*" for fn in target.functions]


def run_target(name: str, target: Target, root: Path, *, timeout: float, jobs: int, diffs: bool = False) -> Score:
    """mutmut over ``target`` in a copy of its own under ``root`` (kept afterwards: ``mutmut results`` and ``mutmut
    show`` work there), then its results read back."""
    workdir = root / name
    shutil.rmtree(workdir, ignore_errors=True)
    copy_checkout(workdir)
    missing = [t for t in target.tests if not (workdir / t).is_file()]
    if missing:
        raise SystemExit(f"{name}: test files {missing} are not in the checkout; TARGETS names what exists")
    configure(workdir, target)
    module = workdir / target.module
    for fn in target.pasted:
        module.write_text(re.sub(rf"(?m)^(def {fn}\(.*\):)$", r"\1  # pragma: no mutate block", module.read_text()))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("ATEN_CPU_CAPABILITY", "default")
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor-default"))
    env["SP_LAB_OUT"] = str(workdir / "out")
    mutmut = [sys.executable, "-m", "mutmut"]
    score = Score(name, target.module, list(target.tests))
    started = time.perf_counter()
    try:
        run = subprocess.run([*mutmut, "run", "--max-children", str(jobs), *mutant_globs(target)], check=False,
                             cwd=workdir, env=env, timeout=timeout, capture_output=True, text=True)
        if run.returncode != 0:
            score.error = f"mutmut run failed (exit {run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}"
    except subprocess.TimeoutExpired:
        score.complete = False  # what was checked before the limit still counts; the rest is "not checked"
    score.seconds = time.perf_counter() - started
    results = subprocess.run([*mutmut, "results", "--all", "true"], cwd=workdir, env=env, check=False,
                             capture_output=True, text=True).stdout
    globs = mutant_globs(target)
    for line in results.splitlines():
        match = STATUS_LINE.match(line)
        if not match:
            continue
        mutant, status = match.groups()
        if globs and not any(re.fullmatch(g.replace(".", r"\.").replace("*", ".*"), mutant) for g in globs):
            continue
        score.statuses[status] = score.statuses.get(status, 0) + 1
        if status not in KILLED and status != "not checked":
            score.survivors.append(mutant)
            if diffs:  # a few seconds each
                score.diffs[mutant] = show(workdir, mutant)
    return score


def show(workdir: Path, mutant: str) -> str:
    """The diff of one mutant (``mutmut show``)."""
    return subprocess.run([sys.executable, "-m", "mutmut", "show", mutant], check=False, cwd=workdir,
                          capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"modules to run, of {', '.join(TARGETS)} "
                        "(default: all)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per module (default 1800)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1: a shared machine)")
    parser.add_argument("--nice", type=int, default=10, help="niceness of this run (default 10)")
    parser.add_argument("--workdir", type=Path, help="where the copies live, one per module (default: a temporary "
                        "directory)")
    parser.add_argument("--show-survivors", action="store_true", help="print each survivor's diff")
    parser.add_argument("--json", type=Path, help="also write the scores to this file")
    options = parser.parse_args(argv)
    unknown = [n for n in options.names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown module {', '.join(unknown)}: choose among {', '.join(TARGETS)}")
    try:
        import mutmut  # noqa: F401
    except ImportError:
        raise SystemExit('mutmut is not installed: pip install "mutmut==3.8.1"') from None
    os.nice(options.nice)
    names = options.names or list(TARGETS)
    root = options.workdir or Path(tempfile.mkdtemp(prefix="sp_lab_mutation_"))
    root.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from machine import describe, machine

    print(f"machine: {describe(machine())}")
    print(f"copies: {root}/<module> (mutmut results / mutmut show there)")
    scores = []
    for name in names:
        score = run_target(name, TARGETS[name], root, timeout=options.timeout, jobs=options.jobs,
                           diffs=options.show_survivors)
        scores.append(score)
        if score.error:
            print(f"{name:13s} {score.module:38s} {score.error}", flush=True)
            continue
        shown = "-" if score.score is None else f"{score.score:.1%}"
        statuses = ", ".join(f"{status} {n}" for status, n in sorted(score.statuses.items()))
        print(f"{name:13s} {score.module:38s} score {shown:>6s} of {score.mutants:4d} mutants ({statuses}) "
              f"in {score.seconds:.0f} s{'' if score.complete else ' (timed out: incomplete)'}", flush=True)
        for mutant in score.survivors:
            print(f"    survived: {mutant}")
            if options.show_survivors:
                print("      " + score.diffs[mutant].strip().replace("\n", "\n      "))
    if options.json:
        options.json.write_text(json.dumps({"machine": machine(), "scores": [
            {**asdict(s), "score": s.score, "mutants": s.mutants} for s in scores]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
