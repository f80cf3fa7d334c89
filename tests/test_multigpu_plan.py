"""Issue #7's multi-GPU run, without GPUs: the plan, the sp_lab command lines, the scheduler's budget and
device sets, what comes back from $OUT, and the comparison with the performance model on fixture rows.

The full CPU dry run (real ``torchrun ... sp_lab run`` jobs on gloo ranks) takes minutes on two cores; it is
``benchmarks/multigpu/dry_run.py``, not a test.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import tarfile
import time
from pathlib import Path

import polars as pl
import pytest
from test_store import make_row

from sp_lab.bench.store import SweepStore
from sp_lab.cli import build_parser
from sp_lab.config import LabConfig

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"multigpu_{name}", REPO / "benchmarks" / "multigpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


plan = _load("plan")
compare = _load("compare")


# ---------------------------------------------------------------------------------------------- the plan


@pytest.mark.parametrize(
    ("gpus", "ids"),
    [
        (2, ["llama-2-7b_tp2_sharded", "llama-3-8b_tp2_sharded", "llama-2-7b_tp2_gather", "llama-3-8b_tp2_gather"]),
        (4, ["llama-3-8b_tp4_sharded", "llama-3-8b_tp4_gather", "llama-2-7b_tp2_sharded", "llama-3-8b_tp2_sharded",
             "llama-2-7b_tp2_gather", "llama-3-8b_tp2_gather"]),
        (8, ["llama-3-70b_tp8_sharded", "llama-3-70b_tp8_gather", "llama-3-8b_tp4_sharded", "llama-3-8b_tp4_gather",
             "llama-2-7b_tp2_sharded", "llama-3-8b_tp2_sharded", "llama-2-7b_tp2_gather", "llama-3-8b_tp2_gather"]),
    ],
)
def test_the_largest_tp_that_fits_goes_first_and_sharded_before_gather(gpus, ids):
    assert [job.id for job in plan.plan_jobs(gpus)] == ids


def test_plan_errors_name_the_fix():
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        plan.plan_jobs(1)
    with pytest.raises(ValueError, match="planned models are"):
        plan.plan_jobs(8, only=["llama-3-405b"])
    assert {j.planned_model for j in plan.plan_jobs(8, only=["llama-3-8b"])} == {"llama-3-8b"}


def test_the_70b_shape_keeps_few_layers_and_the_ladder_spans_1_to_16384():
    jobs = {job.id: job for job in plan.plan_jobs(8)}
    assert jobs["llama-3-70b_tp8_sharded"].num_layers == 4
    assert plan.GPU_PROFILE.tokens[0] == 1 and plan.GPU_PROFILE.tokens[-1] == 16384
    assert plan.GPU_PROFILE.backend == "nccl" and plan.GPU_PROFILE.cudagraphs


@pytest.mark.parametrize("profile", [plan.GPU_PROFILE, plan.CPU_PROFILE], ids=lambda p: p.name)
def test_every_job_command_parses_with_the_cli_and_its_config_loads(profile, tmp_path):
    for job in plan.plan_jobs(8, profile):
        config_path = tmp_path / f"{job.id}.json"
        config_path.write_text(plan.base_config_json(job, profile))
        sp_args = plan.sp_lab_run_args(job, profile, job_dir=tmp_path / job.id, config_path=config_path)
        args = build_parser().parse_args(sp_args)  # the CLI itself judges the flags
        assert (args.command, args.model, args.tp, args.boundary) == ("run", job.model, job.tp, job.boundary)
        assert args.tokens == list(profile.tokens) and args.dtype == profile.dtype
        assert args.backend == profile.backend and args.num_layers == job.num_layers
        # interleaved timing to a stated interval width, inside a timing budget (sp_lab run's sweep)
        assert (args.ci_width, args.budget) == (profile.ci_width, profile.timing_budget_s)
        config = LabConfig.from_json(args.config)
        assert (config.tp_size, config.boundary, config.cudagraphs) == (job.tp, job.boundary, True)
        assert config.max_num_tokens >= max(profile.tokens)
        argv = plan.torchrun_argv(job, sp_args)
        assert argv[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(job.tp)]
        assert argv[6:8] == ["-m", "sp_lab"]


# ---------------------------------------------------------------------------------------------- the scheduler


def _sleeper(seconds: dict[str, float]):
    """Jobs that record their devices and start/end times, then sleep (real processes, no torch)."""

    def argv_for(job, job_dir):
        code = (
            "import json, os, sys, time; t0 = time.time(); time.sleep(float(sys.argv[1])); "
            "json.dump({'devices': os.environ['CUDA_VISIBLE_DEVICES'], 'nvls': os.environ['NCCL_NVLS_ENABLE'], "
            "'t0': t0, 't1': time.time()}, open(sys.argv[2], 'w'))"
        )
        return [sys.executable, "-c", code, str(seconds[job.id]), str(job_dir / "ran.json")]

    return argv_for


def test_jobs_on_disjoint_devices_run_together_and_the_budget_stops_and_skips(tmp_path):
    jobs = plan.plan_jobs(4)[:4]  # tp4 sharded, tp4 gather, 7b tp2 sharded, 8b tp2 sharded
    profile = plan.Profile(name="test", tokens=(1,), dtype="float32", backend="gloo", warmup=0, repeats=1,
                           cudagraphs=False, min_job_s=1.5, reserve_s=0.0)
    seconds = {jobs[0].id: 0.2, jobs[1].id: 0.2, jobs[2].id: 1.0, jobs[3].id: 60.0}
    start = time.monotonic()
    runs = plan.execute(jobs, devices=4, budget_s=4.5, profile=profile, work=tmp_path, argv_for=_sleeper(seconds),
                        poll_s=0.05, log=lambda s: None)
    elapsed = time.monotonic() - start
    status = {r.job.id: r.status for r in runs}
    assert status == {jobs[0].id: "ok", jobs[1].id: "ok", jobs[2].id: "ok", jobs[3].id: "stopped"}
    assert elapsed < 20, "the stopped job must not run to its 60 s"
    ran = {j.id: json.loads((tmp_path / j.id / "ran.json").read_text()) for j in jobs[:3]}
    assert ran[jobs[0].id]["devices"] == "0,1,2,3" and ran[jobs[0].id]["nvls"] == "0"
    # the two tp=2 jobs share no GPU and start together
    assert {ran[jobs[2].id]["devices"], ",".join(map(str, runs[3].devices))} == {"0,1", "2,3"}
    assert runs[2].start_s == pytest.approx(runs[3].start_s, abs=0.5)
    # the tp4 jobs ran one after the other, never beside anything
    assert ran[jobs[0].id]["t1"] <= ran[jobs[1].id]["t0"] + 0.05

    # with too little budget left a job is not started at all
    late = plan.execute(jobs[2:3], devices=2, budget_s=1.0, profile=profile, work=tmp_path / "late",
                        argv_for=_sleeper(seconds), poll_s=0.05, log=lambda s: None)
    assert late[0].status == "skipped" and "budget" in late[0].reason


# ---------------------------------------------------------------------------------------------- what comes back


def _curve(model="llama-3-8b", tp=2, boundary="sharded", hidden=4096, threshold=64):
    """Rows like a finished job's: fusion pays from 64 tokens on; the tuned config gates there."""
    tuned_cfg = LabConfig(tp_size=tp, boundary=boundary, async_tp_min_tokens=threshold)
    common = {"model": model, "tp": tp, "boundary": boundary, "hidden_size": hidden, "num_layers": 8,
              "dtype": "bfloat16", "device_name": "NVIDIA H200", "backend": "nccl", "timing_method": "cuda_graph"}
    rows = []
    for t in (1, 4, 16, 64, 256, 1024):
        base = 200.0 + t
        fused = base * (1.3 if t < threshold else 0.85)
        for variant, latency in (("baseline", base), ("sp", base * 1.02), ("sp+async_tp", fused),
                                 ("tuned", fused * 1.01 if t >= threshold else base * 1.01)):
            extra = {"config_json": tuned_cfg.to_json(), "async_tp_min_tokens": threshold} if variant == "tuned" else {}
            rows.append(make_row(t, variant=variant, reported_variant=variant, latency_us=latency,
                                 config_hash=variant, **common, **extra))
    return rows


def test_collect_returns_few_files_one_parquet_and_a_bundle(tmp_path):
    jobs = plan.plan_jobs(2)[:2]
    runs = []
    for job in jobs:
        job_dir = tmp_path / "work" / job.id
        SweepStore(job_dir / "sweeps").append(_curve(model=job.planned_model, boundary=job.boundary))
        (job_dir / "base_config.json").write_text(plan.base_config_json(job, plan.GPU_PROFILE))
        (job_dir / "job.log").write_text("done\n")
        runs.append(plan.JobRun(job, status="ok", devices=[0, 1], start_s=0.0, wall_s=1.0, returncode=0))
    out = tmp_path / "out"
    summary = plan.collect(runs, work=tmp_path / "work", out=out, profile=plan.CPU_PROFILE, devices=2,
                           log=lambda s: None)

    files = sorted(p.name for p in out.iterdir())
    assert files == ["bundle.tar.gz", "multigpu_rows.parquet", "summary.json"]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)
    assert all((out / f).stat().st_size < plan.MAX_RETURN_BYTES for f in files)
    rows = pl.read_parquet(out / "multigpu_rows.parquet")
    assert rows.height == 2 * 24 and set(rows["model"]) == {j.planned_model for j in jobs}
    assert summary["rows"] == rows.height
    with tarfile.open(out / "bundle.tar.gz") as tar:
        names = tar.getnames()
    for job in jobs:
        assert f"tune/{job.id}.json" in names
        assert f"jobs/{job.id}/job.log" in names
        assert any(n.startswith(f"configs/{job.id}/device_name=") for n in names)  # exported from the rows
    entry = summary["jobs"][0]
    assert entry["recommendation"]["async_tp_min_tokens"] == 64 and entry["rows"] == 24


# ---------------------------------------------------------------------------------------------- comparison


def test_compare_reports_error_per_point_speedup_threshold_and_regret(tmp_path):
    from sp_lab.tuning.predict.kernels import MatmulTable

    store = SweepStore(tmp_path / "s")
    store.append(_curve())
    measured = store.read()

    errors = compare.prediction_errors(measured, MatmulTable.default(), collected_tables=False)
    assert errors.height == 4 * 6  # every (variant, token count) measured has a prediction
    assert errors["predicted_us"].is_finite().all() and (errors["predicted_us"] > 0).all()
    assert set(errors["matmul_model"]) == {"h200 table"}  # llama-3-8b tp2 shapes were measured on the H200
    base = errors.filter(pl.col("variant") == "baseline")
    assert (base["delta_error_us"].abs() < 1e-9).all()
    tuned = errors.filter(pl.col("variant") == "tuned").sort("num_tokens")
    fused = errors.filter(pl.col("variant") == "sp+async_tp").sort("num_tokens")
    above = tuned["num_tokens"] >= 64
    assert (tuned.filter(above)["predicted_us"] == fused.filter(above)["predicted_us"]).all()

    speed = compare.speedups(measured).sort("num_tokens")
    assert speed["speedup_sp_async_tp"][0] == pytest.approx(1 / 1.3) and speed["speedup_sp_async_tp"][-1] > 1
    thr = compare.thresholds(measured).row(0, named=True)
    assert thr["tuned_async_tp_min_tokens"] == "64" and thr["recommended_from_rows"] == "64"
    reg = compare.regret(measured).sort("num_tokens")
    assert reg["regret_rel"].to_list() == pytest.approx([0.0] * 6)  # it runs the best variant everywhere
    assert reg["tuned_vs_run"].to_list() == pytest.approx([0.01] * 6)  # and measured 1% slower than it

    rows_file = tmp_path / "rows.parquet"
    measured.write_parquet(rows_file)
    assert compare.main([str(rows_file), "--out", str(tmp_path / "cmp")]) == 0
    assert {"comparison.md", "prediction_errors.csv", "regret.csv", "speedup.csv", "thresholds.csv"} <= {
        p.name for p in (tmp_path / "cmp").iterdir()}


def test_llama_2_7b_shapes_fall_back_to_the_roofline_fit():
    from sp_lab.tuning.predict.kernels import MatmulTable

    measured = pl.DataFrame(_curve(model="llama-2-7b"))
    errors = compare.prediction_errors(measured, MatmulTable.default(), collected_tables=False)
    assert set(errors["matmul_model"]) == {"roofline fit"} and errors.height == 24


def test_the_collected_gemm_table_serves_where_aiconfigurator_core_has_it():
    pytest.importorskip("aiconfigurator_core", reason="the collected tables come with aiconfigurator-core")
    from sp_lab.tuning.predict.kernels import MatmulTable

    errors = compare.prediction_errors(pl.DataFrame(_curve(model="llama-2-7b")), MatmulTable.default())
    assert set(errors["matmul_model"]) == {"collected table"} and errors.height == 24


def test_a_job_that_only_lacked_plotly_for_its_report_counts_as_done(tmp_path):
    (tmp_path / "job.log").write_text("[4/5] tuned config -> x\nModuleNotFoundError: No module named 'plotly'\n")
    assert plan._classify(1, tmp_path)[0] == "failed"  # nothing exported yet: a real failure
    (tmp_path / "device_name=NVIDIA_H200,tp=2,model=llama-3-8b,dtype=bfloat16.json").write_text("{}")
    status, reason = plan._classify(1, tmp_path)
    assert status == "ok" and "plotly" in reason
    assert plan._classify(0, tmp_path) == ("ok", "")
