"""Issue #7's multi-GPU run: which sweeps fit this machine, running them inside a time budget, and the files
that come back.

One call on an N-GPU device machine (``benchmarks/multigpu/run.sh`` sets the environment and calls
``python benchmarks/multigpu/plan.py run``):

1. **Plan** (:func:`plan_jobs`): every (model, tp, boundary) of :data:`MATRIX` whose tp fits the visible GPUs,
   the largest tp first (it is why this machine was asked for), ``sharded`` before ``gather``.
2. **Run** (:func:`execute`): each job is one ``torchrun --standalone --nproc-per-node TP -m sp_lab run ...``
   on its own GPUs (``CUDA_VISIBLE_DEVICES``). ``sp_lab run`` sweeps baseline / sp / sp+async_tp over the
   token ladder, tunes the policy on rank 0, measures the tuned config, exports it and writes a report:
   all four variants in one process, so NCCL, Inductor and the model are set up once per job. Within a
   job the variants are **interleaved per token count** (each variant in turn, order rotated every round,
   until each median's 95% interval is within ``ci_width`` or the job's timing budget ends), so a
   neighbouring job that starts or stops on the same host shifts every variant alike instead of one
   variant's block. Jobs whose GPU sets do not overlap run at the same time (a 4-GPU machine runs both
   tp=2 jobs side by side). Every job has a deadline inside the global budget; a job past it is stopped (SIGTERM, then
   SIGKILL to its whole process group). Rows are on disk as soon as they are measured, so a stopped job
   still contributes what it finished.
3. **Collect** (:func:`collect`): all rows into ONE parquet file, per job ``sp_lab tune --json`` and, where
   ``sp_lab run`` did not get that far, ``sp_lab export`` / ``sp_lab report``; configs, reports, compile
   reports and logs into one ``bundle.tar.gz``; ``summary.json`` with the plan, what ran where and for how
   long, the GPUs and their topology, and what each job's effective config said (symm_mem or not).

The remote GPU runner this is written for returns at most 8 files from ``$OUT`` (16 MiB each, 2 folders deep);
this writes four:
``multigpu_rows.parquet``, ``summary.json``, ``bundle.tar.gz`` and (from run.sh) ``run.log``.

``--profile cpu`` runs the same plan with the toy model on gloo ranks and a few token counts, so the
scheduling, the CLI arguments and the output layout can be checked on a machine without GPUs
(``benchmarks/multigpu/dry_run.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without installing

# (model preset, tp, decoder layers kept). The 7B/8B models keep 8 of their 32 layers and the 70B shape 4 of
# its 80: compile cost does not grow with depth (identical layers share one artifact) but weight
# initialisation, CUDA-graph captures and the 10-minute call do. Per-layer effects are what the
# comparison needs; the performance model is evaluated for the same depth.
MATRIX: tuple[tuple[str, int, int], ...] = (
    ("llama-2-7b", 2, 8),
    ("llama-3-8b", 2, 8),
    ("llama-3-8b", 4, 8),
    ("llama-3-70b", 8, 4),
)
BOUNDARIES = ("sharded", "gather")
TOKEN_LADDER = tuple(2**i for i in range(15))  # 1 .. 16384

# Environment every job gets: NVLink multicast stays off in NCCL, PyTorch and NVSHMEM (KINDS.md: a program
# using it can take a shared host's GPUs out of service for a day or more).
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# What the remote GPU runner sends back: 8 files, 16 MiB each. Keep a margin.
MAX_RETURN_BYTES = 15 * 2**20


@dataclasses.dataclass(frozen=True)
class Profile:
    """How every job of a plan is run (sizes, timing, backend)."""

    name: str
    """``"gpu"`` (the real run) or ``"cpu"`` (the dry run)."""
    tokens: tuple[int, ...]
    """Token counts of every sweep (one flattened sequence of that many tokens per call)."""
    dtype: str
    """Model dtype passed to ``--dtype``."""
    backend: str
    """Process-group backend passed to ``--backend`` (``nccl`` on GPUs; ``gloo`` for the dry run)."""
    warmup: int
    """Untimed calls per point (after the compiling call)."""
    repeats: int
    """Least timed calls per point; the row keeps their median (each call timed on the slowest rank)."""
    cudagraphs: bool
    """``LabConfig.cudagraphs``: capture each compiled piece per token count, as vLLM's piecewise mode."""
    model: str | None = None
    """Replace every planned model with this one (the dry run uses ``"toy"``); ``None`` keeps the plan's."""
    num_layers: int | None = None
    """Replace every planned layer count; ``None`` keeps :data:`MATRIX`'s."""
    collective_timeout_s: float = 300.0
    """``--timeout``: under torchrun it bounds every collective, so a hung rank fails instead of hanging."""
    min_job_s: float = 150.0
    """A job is not started with less budget than this left (it could not finish its first variants)."""
    reserve_s: float = 45.0
    """Budget kept back for collecting, tuning, exporting and packing once the jobs are done."""
    ci_width: float = 0.03
    """``--ci-width``: rounds go on until every median's 95% interval is this fraction of it ..."""
    timing_budget_s: float | None = 240.0
    """``--budget``: ... or until a job has spent this long timing (shared by its token counts)."""


GPU_PROFILE = Profile(
    name="gpu", tokens=TOKEN_LADDER, dtype="bfloat16", backend="nccl", warmup=3, repeats=10, cudagraphs=True
)
CPU_PROFILE = Profile(
    name="cpu",
    tokens=(1, 4, 16),
    dtype="float32",
    backend="gloo",
    warmup=1,
    repeats=2,
    cudagraphs=True,  # dropped with a reason on CPU; kept so the config file is the GPU run's
    model="toy",
    num_layers=None,
    min_job_s=20.0,
    reserve_s=10.0,
    timing_budget_s=20.0,
)
PROFILES = {p.name: p for p in (GPU_PROFILE, CPU_PROFILE)}


@dataclasses.dataclass(frozen=True)
class Job:
    """One ``sp_lab run`` under torchrun: one model at one tp with one boundary strategy."""

    model: str
    """Model preset (or ``"toy"`` in the dry run)."""
    planned_model: str
    """The preset the plan asked for (differs from ``model`` only in the dry run)."""
    tp: int
    """Tensor-parallel size = ranks = GPUs."""
    boundary: str
    """``LabConfig.boundary``: ``"sharded"`` or ``"gather"``."""
    num_layers: int | None
    """Decoder layers kept (``--num-layers``); ``None`` keeps the model's."""

    @property
    def id(self) -> str:
        """``llama-3-8b_tp2_sharded``: folder and log names (letters, digits, '.', '_', '-' only)."""
        return f"{self.planned_model}_tp{self.tp}_{self.boundary}"


def plan_jobs(gpus: int, profile: Profile = GPU_PROFILE, *, only: Sequence[str] = ()) -> list[Job]:
    """The jobs an ``gpus``-GPU machine runs, in priority order.

    Largest tp first (the shapes that need this machine), then :data:`MATRIX` order; within one
    (model, tp) ``sharded`` before ``gather``. ``only`` keeps the jobs whose planned model is listed.
    Raises ValueError when nothing fits (fewer than 2 GPUs) or ``only`` names no planned model.
    """
    if gpus < 2:
        raise ValueError(f"gpus={gpus}: the smallest planned tp is 2; run on a machine with at least 2 GPUs")
    known = sorted({m for m, _, _ in MATRIX})
    bad = sorted(set(only) - set(known))
    if bad:
        raise ValueError(f"--only {bad}: not in the plan; planned models are {known}")
    fitting = [(m, tp, layers) for m, tp, layers in MATRIX if tp <= gpus and (not only or m in only)]
    fitting.sort(key=lambda entry: -entry[1])  # stable: MATRIX order within one tp
    jobs = []
    for boundary_rank, boundary in enumerate(BOUNDARIES):
        for m, tp, layers in fitting:
            jobs.append((boundary_rank, Job(
                model=profile.model or m,
                planned_model=m,
                tp=tp,
                boundary=boundary,
                num_layers=profile.num_layers if profile.model else layers,
            )))
    # sharded first for every tp, but never let a smaller tp's job jump ahead of a larger tp's.
    jobs.sort(key=lambda item: (-item[1].tp, item[0]))
    return [job for _, job in jobs]


# ---------------------------------------------------------------------------------------------- commands


def base_config_json(job: Job, profile: Profile) -> str:
    """The ``--config`` LabConfig file of a job: tp, boundary, CUDA graphs, room for the largest count."""
    from sp_lab.config import LabConfig

    config = LabConfig(
        tp_size=job.tp,
        boundary=job.boundary,
        cudagraphs=profile.cudagraphs,
        max_num_tokens=max(16384, max(profile.tokens)),
    )
    return config.to_json()


def sp_lab_run_args(job: Job, profile: Profile, *, job_dir: Path, config_path: Path) -> list[str]:
    """Arguments of ``python -m sp_lab`` for one job (checked against the CLI's parser by the tests)."""
    args = [
        "run",
        "--model", job.model,
        "--tp", str(job.tp),
        "--dtype", profile.dtype,
        "--boundary", job.boundary,
        "--config", str(config_path),
        "--tokens", ",".join(map(str, profile.tokens)),
        "--warmup", str(profile.warmup),
        "--repeats", str(profile.repeats),
        "--ci-width", str(profile.ci_width),
        *(["--budget", str(profile.timing_budget_s)] if profile.timing_budget_s is not None else []),
        "--backend", profile.backend,
        "--timeout", str(profile.collective_timeout_s),
        "--out", str(job_dir),
        "--store", str(job_dir / "sweeps"),
        "--cdn",  # the report loads plotly.js from its CDN: ~100 KB instead of ~4.6 MB per report
    ]
    if job.num_layers is not None:
        args += ["--num-layers", str(job.num_layers)]
    return args


def torchrun_argv(job: Job, sp_lab_args: Sequence[str]) -> list[str]:
    """``python -m torch.distributed.run --standalone ...``: this interpreter (and its PYTHONPATH), a free
    rendezvous port per job, so jobs on disjoint GPUs can run at once."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc-per-node", str(job.tp),
        "-m", "sp_lab", *sp_lab_args,
    ]


# ---------------------------------------------------------------------------------------------- running


@dataclasses.dataclass
class JobRun:
    """What happened to one job."""

    job: Job
    """The job."""
    status: str = "pending"
    """``pending`` -> ``running`` -> ``ok`` | ``failed`` | ``stopped`` (past its deadline) | ``skipped``."""
    devices: list[int] = dataclasses.field(default_factory=list)
    """GPU indices (or CPU slots in the dry run) it ran on."""
    start_s: float | None = None
    """Seconds after the run's start when the job started."""
    wall_s: float | None = None
    """How long it ran."""
    returncode: int | None = None
    """torchrun's exit status (negative: killed by that signal)."""
    reason: str = ""
    """Why it was skipped or stopped."""
    process: Any = dataclasses.field(default=None, repr=False)
    deadline: float = dataclasses.field(default=0.0, repr=False)
    log: Any = dataclasses.field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.job.id,
            **dataclasses.asdict(self.job),
            "status": self.status,
            "devices": self.devices,
            "start_s": self.start_s,
            "wall_s": self.wall_s,
            "returncode": self.returncode,
            "reason": self.reason,
        }


def _classify(returncode: int, job_dir: Path) -> tuple[str, str]:
    """``("ok" | "failed", reason)`` for a finished job.

    ``sp_lab run`` draws its HTML report last, with plotly, which the device image lacks and the carried
    wheels leave out (size): a job that exported its tuned config and then failed importing plotly has
    done everything this run needs (the reports are rebuilt from the rows, README.md).
    """
    if returncode == 0:
        return "ok", ""
    log = (job_dir / "job.log").read_text(errors="replace") if (job_dir / "job.log").exists() else ""
    exported = any(job_dir.glob("device_name=*.json"))
    if exported and "No module named 'plotly'" in log:
        return "ok", "no HTML report: plotly is not installed there (rebuild it from the rows)"
    return "failed", f"torchrun exited with {returncode}; see jobs/<id>/job.log in the bundle"


def _free_block(free: set[int], size: int, total: int) -> list[int] | None:
    """An aligned block of ``size`` free devices (0-1, 2-3, ... for tp 2), else any ``size`` free ones."""
    for start in range(0, total - size + 1, size):
        block = list(range(start, start + size))
        if free.issuperset(block):
            return block
    return sorted(free)[:size] if len(free) >= size else None


def _stop(run: JobRun, grace_s: float = 10.0) -> None:
    """SIGTERM the job's process group (torchrun and its ranks), then SIGKILL what is left."""
    proc = run.process
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def execute(
    jobs: Sequence[Job],
    *,
    devices: int,
    budget_s: float,
    profile: Profile,
    work: Path,
    argv_for: Callable[[Job, Path], list[str]] | None = None,
    env_for: Callable[[Job, list[int]], dict[str, str]] | None = None,
    poll_s: float = 1.0,
    log: Callable[[str], None] = print,
) -> list[JobRun]:
    """Run ``jobs`` (priority order) on ``devices`` devices within ``budget_s`` seconds; return what happened.

    A job starts once enough devices are free (the highest-priority job that fits goes first) and at
    least ``profile.min_job_s`` of budget is left; it is stopped at ``budget - profile.reserve_s``.
    ``argv_for(job, job_dir)`` gives its command (default: :func:`torchrun_argv` of
    :func:`sp_lab_run_args`); ``env_for(job, devices)`` its extra environment (default: ``SAFE_ENV`` and
    ``CUDA_VISIBLE_DEVICES``). Output goes to ``work/<job id>/job.log``.
    """
    start = time.monotonic()
    stop_at = start + budget_s - profile.reserve_s
    runs = [JobRun(job) for job in jobs]
    free = set(range(devices))

    def default_argv(job: Job, job_dir: Path) -> list[str]:
        config_path = job_dir / "base_config.json"
        config_path.write_text(base_config_json(job, profile))
        return torchrun_argv(job, sp_lab_run_args(job, profile, job_dir=job_dir, config_path=config_path))

    def default_env(job: Job, devs: list[int]) -> dict[str, str]:
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        return {**SAFE_ENV, "CUDA_VISIBLE_DEVICES": ",".join(map(str, devs)), "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": path}

    argv_for = argv_for or default_argv
    env_for = env_for or default_env
    for run in runs:
        if run.job.tp > devices:
            run.status, run.reason = "skipped", f"needs {run.job.tp} devices, {devices} available"

    while True:
        now = time.monotonic()
        for run in [r for r in runs if r.status == "running"]:
            rc = run.process.poll()
            if rc is None and now > run.deadline:
                log(f"[plan] {run.job.id}: budget reached after {now - start - run.start_s:.0f} s, stopping it")
                _stop(run)
                rc = run.process.poll()
                run.status, run.reason = "stopped", "stopped at the budget's deadline; its measured rows are kept"
            elif rc is not None:
                run.status, run.reason = _classify(rc, work / run.job.id)
            if rc is not None or run.status == "stopped":
                run.returncode = run.process.returncode
                run.wall_s = round(time.monotonic() - start - run.start_s, 1)
                run.log.close()
                free.update(run.devices)
                log(f"[plan] {run.job.id}: {run.status} (rc={run.returncode}) after {run.wall_s:.0f} s "
                    f"on devices {run.devices}")
        for run in runs:
            if run.status != "pending":
                continue
            left = stop_at - time.monotonic()
            if left < profile.min_job_s:
                run.status = "skipped"
                run.reason = f"only {max(left, 0):.0f} s of budget left (< min_job_s={profile.min_job_s:.0f})"
                log(f"[plan] {run.job.id}: skipped, {run.reason}")
                continue
            block = _free_block(free, run.job.tp, devices)
            if block is None:
                continue
            job_dir = work / run.job.id
            job_dir.mkdir(parents=True, exist_ok=True)
            argv = argv_for(run.job, job_dir)
            (job_dir / "command.json").write_text(json.dumps({"argv": argv, "devices": block}, indent=1))
            run.log = open(job_dir / "job.log", "w")  # noqa: SIM115 - closed when the job ends
            run.process = subprocess.Popen(
                argv,
                cwd=REPO,
                env={**os.environ, **env_for(run.job, block)},
                stdout=run.log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopping it reaches every rank
            )
            run.status, run.devices = "running", block
            run.start_s = round(time.monotonic() - start, 1)
            run.deadline = stop_at
            free.difference_update(block)
            log(f"[plan] {run.job.id}: started on devices {block} at t={run.start_s:.0f} s "
                f"({stop_at - time.monotonic():.0f} s of budget left)")
        if not any(r.status in ("pending", "running") for r in runs):
            return runs
        time.sleep(poll_s)


# ---------------------------------------------------------------------------------------------- collecting


def _cli(args: Sequence[str], log: Callable[[str], None]) -> int:
    """``python -m sp_lab ARGS`` in this process (same code path, no interpreter start-up per call)."""
    from sp_lab.cli import main

    out, err = io.StringIO(), io.StringIO()
    import contextlib

    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(args))
    except Exception as e:  # noqa: BLE001 - one job's broken rows must not stop the others' collection
        rc, err = 1, io.StringIO(f"{type(e).__name__}: {e}")
    text = (out.getvalue() + err.getvalue()).strip()
    log(f"[collect] sp_lab {args[0]} -> rc={rc}" + (f"\n{text}" if text and rc else ""))
    return rc


def _effective(job_dir: Path) -> dict[str, Any] | None:
    """The effective config and provenance of the job's sp+async_tp compile (symm_mem or not, and why)."""
    path = job_dir / "compile_reports" / "sp+async_tp.json"
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    effective = report.get("effective", {})
    return {k: effective.get(k) for k in ("enable_sp", "enable_async_tp", "fused_op_impl", "symm_mem",
                                          "cudagraphs", "backend", "reasons")}


def gpu_info() -> dict[str, Any]:
    """What the machine says about its GPUs and how they are linked (``nvidia-smi -L`` / ``topo -m``)."""
    info: dict[str, Any] = {}
    for key, cmd in (("gpus", ["nvidia-smi", "-L"]), ("topology", ["nvidia-smi", "topo", "-m"]),
                     ("driver", ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])):
        try:
            info[key] = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            info[key] = f"unavailable: {e}"
    return info


def collect(runs: Sequence[JobRun], *, work: Path, out: Path, profile: Profile, devices: int,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """Combine every job's rows into ``out/multigpu_rows.parquet``, tune / export / report per job, pack the
    rest into ``out/bundle.tar.gz`` and write ``out/summary.json``; returns the summary."""
    import polars as pl

    from sp_lab.bench.store import SweepStore

    out.mkdir(parents=True, exist_ok=True)
    bundle = work / "bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    frames, jobs = [], []
    for run in runs:
        job, job_dir = run.job, work / run.job.id
        entry = run.to_dict()
        store = job_dir / "sweeps"
        rows = SweepStore(store).read(skip_corrupt=True) if store.is_dir() else None
        entry["rows"] = 0 if rows is None else rows.height
        if rows is not None and rows.height:
            frames.append(rows)
            entry["variants"] = sorted(rows["variant"].unique().to_list())
            entry["fusion_missing_rows"] = int(rows["fusion_missing"].sum())
            entry["timing_methods"] = sorted(rows["timing_method"].unique().to_list())
            tune_json = bundle / "tune" / f"{job.id}.json"
            if _cli(["tune", "--store", str(store), "--json", str(tune_json)], log) == 0:
                entry["recommendation"] = json.loads(tune_json.read_text())
            configs = sorted(job_dir.glob("device_name=*.json"))
            config_dir = bundle / "configs" / job.id  # one folder per job: file names omit the boundary
            if configs:  # sp_lab run exported it after measuring the tuned config
                config_dir.mkdir(parents=True, exist_ok=True)
                for path in configs:
                    shutil.copy2(path, config_dir / path.name)
            else:
                _cli(["export", "--store", str(store), "--config", str(job_dir / "base_config.json"),
                      "--out", str(config_dir)], log)
            entry["configs"] = sorted(str(p.relative_to(bundle)) for p in config_dir.glob("*.json"))
            report = bundle / "reports" / f"{job.id}.html"
            report.parent.mkdir(parents=True, exist_ok=True)
            if (job_dir / "report.html").exists():
                shutil.copy2(job_dir / "report.html", report)
            elif importlib.util.find_spec("plotly") is not None:
                _cli(["report", "--store", str(store), "--cdn", "--out", str(report)], log)
        entry["effective_sp+async_tp"] = _effective(job_dir)
        for name in ("job.log", "command.json", "base_config.json"):
            if (job_dir / name).exists():
                dest = bundle / "jobs" / job.id / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(job_dir / name, dest)
        if (job_dir / "compile_reports").is_dir():
            shutil.copytree(job_dir / "compile_reports", bundle / "compile_reports" / job.id)
        jobs.append(entry)

    rows_path = out / "multigpu_rows.parquet"
    if frames:
        combined = pl.concat(frames, how="vertical_relaxed").sort(
            "model", "tp", "boundary", "variant", "num_tokens")
        combined.write_parquet(rows_path, compression="zstd")
    import torch

    summary = {
        "schema": "sp_lab.multigpu_run/1",
        "created_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "profile": dataclasses.asdict(profile),
        "devices": devices,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "machine": gpu_info() if profile.backend == "nccl" else {"note": "dry run on the CPU"},
        "env": {k: os.environ.get(k) for k in SAFE_ENV},
        "rows_file": rows_path.name if frames else None,
        "rows": sum(f.height for f in frames),
        "jobs": jobs,
    }
    (bundle / "summary.json").parent.mkdir(parents=True, exist_ok=True)
    (bundle / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    _pack(bundle, out / "bundle.tar.gz", log)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def _pack(bundle: Path, dest: Path, log: Callable[[str], None]) -> None:
    """tar.gz the bundle; drop the (largest) compile reports if it would not come back."""
    for drop in ((), ("compile_reports",)):
        with tarfile.open(dest, "w:gz") as tar:
            for path in sorted(bundle.iterdir()):
                if path.name not in drop:
                    tar.add(path, arcname=path.name)
        size = dest.stat().st_size
        if size <= MAX_RETURN_BYTES:
            log(f"[collect] {dest.name}: {size / 2**20:.2f} MiB" + (f" (without {drop})" if drop else ""))
            return
    log(f"[collect] WARNING {dest.name} is {size / 2**20:.1f} MiB even without compile reports: "
        "it will not come back; the rows parquet and summary.json still do")


# ---------------------------------------------------------------------------------------------- entry point


def visible_gpus() -> int:
    """GPUs torch sees here (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/multigpu/plan.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "show"):
        p = sub.add_parser(name, help="run the plan" if name == "run" else "print the plan and its commands")
        p.add_argument("--profile", choices=sorted(PROFILES), default="gpu")
        p.add_argument("--gpus", type=int, default=None, help="devices to plan for (default: visible GPUs)")
        p.add_argument("--only", default="", help="comma-separated planned models to keep (e.g. llama-3-8b)")
        p.add_argument("--budget-s", type=float, default=540.0, help="seconds for everything (default 540)")
        p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/multigpu")))
        p.add_argument("--work", type=Path, default=None, help="scratch folder (default OUT/../mg_work)")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    gpus = args.gpus if args.gpus is not None else visible_gpus()
    only = [m for m in args.only.split(",") if m]
    jobs = plan_jobs(gpus, profile, only=only)
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"sp_lab_multigpu_{os.getpid()}"
    if args.command == "show":
        for job in jobs:
            cmd = torchrun_argv(job, sp_lab_run_args(job, profile, job_dir=work / job.id,
                                                     config_path=work / job.id / "base_config.json"))
            print(f"{job.id}: {' '.join(cmd[1:])}")
        return 0
    print(f"[plan] {gpus} device(s), profile {profile.name}, budget {args.budget_s:.0f} s: "
          f"{', '.join(j.id for j in jobs)}", flush=True)
    t0 = time.monotonic()
    runs = execute(jobs, devices=gpus, budget_s=args.budget_s, profile=profile, work=work,
                   log=lambda s: print(s, flush=True))
    summary = collect(runs, work=work, out=args.out, profile=profile, devices=gpus,
                      log=lambda s: print(s, flush=True))
    done = sum(r.status == "ok" for r in runs)
    print(f"[plan] {done}/{len(runs)} job(s) ok, {summary['rows']} row(s), {time.monotonic() - t0:.0f} s; "
          f"files in {args.out}: {', '.join(sorted(p.name for p in args.out.iterdir()))}", flush=True)
    return 0 if done == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
