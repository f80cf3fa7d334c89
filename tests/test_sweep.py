"""Sweeps: provenance on every row, resume after an interruption, the fusion-missing flag, interleaving.

Most tests use a small stand-in model and compiler (injected through ``build_fn`` / ``compile_fn``) so
they measure the sweep machinery, not Inductor: the stand-in model still runs a real all_reduce on gloo
between the ranks. What fused ops ran is asserted only on a real sweep (the toy model through
``sp_lab.compile`` on two gloo ranks): a stand-in report would derive it from the same gates as the
expectation it is checked against.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import typing
from pathlib import Path

import polars as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn

import sp_lab
from sp_lab.bench.store import KEY_COLUMNS, NULLABLE_COLUMNS, ROW_SCHEMA, SweepStore
from sp_lab.bench.sweep import (
    SweepArgumentError,
    SweepResult,
    expectation,
    launch_sweep,
    run_sweep,
    variant_config,
)
from sp_lab.bench.timing import reduce_across_ranks, time_cpu, time_cuda, time_fn
from sp_lab.compiler.ranges import CompileRange
from sp_lab.compiler.report import CompileReport
from sp_lab.config import LabConfig
from sp_lab.distributed.launch import RankError
from sp_lab.models import ModelSpec
from sp_lab.vocabulary import FUSION_MISSING_SUFFIX

TOKENS = [1, 4, 16, 64]
REPO = Path(__file__).resolve().parents[1]


class StandInModel(nn.Module):
    """Embedding -> matmul -> all_reduce (when tp > 1) -> logits: TP-shaped, microseconds to run."""

    def __init__(self, *, tp_size: int, num_layers: int = 2, hidden: int = 16, vocab: int = 32):
        super().__init__()
        self.tp_size = tp_size
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(num_layers))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.spec = ModelSpec(
            name="stand-in",
            hidden_size=hidden,
            intermediate_size=hidden,
            num_layers=num_layers,
            num_heads=1,
            num_kv_heads=1,
            head_dim=hidden,
            vocab_size=vocab,
            dtype="float32",
            residual_inplace=False,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
            if self.tp_size > 1:
                dist.all_reduce(x)
        return self.head(x)


def stand_in_build(model_name, *, tp_rank, tp_size, num_layers, dtype, device, seed, **overrides):
    torch.manual_seed(seed)
    return StandInModel(tp_size=tp_size, num_layers=num_layers or 2).to(dtype=dtype, device=device)


@dataclasses.dataclass
class StandInReport:
    """Answers like CompileReport from the config; ``break_fusion`` plays a fusion that never fires."""

    config: LabConfig
    num_layers: int
    break_fusion: bool = False

    def _active(self, t: int) -> tuple[bool, bool]:
        r = self.config.range_for(t)
        sp = self.config.tp_size > 1 and self.config.sp_active_for(r)
        fused = sp and self.config.async_tp_active_for(r) and not self.break_fusion
        return sp, fused

    def sp_rewrites(self, t: int) -> int:
        return 2 * self.num_layers if self._active(t)[0] else 0

    def fusion_fired(self, t: int) -> bool:
        return self._active(t)[1]

    def op_counts(self, t: int) -> dict[str, int]:
        sp, fused = self._active(t)
        n = self.num_layers
        if not sp:
            return {
                "all_reduce": 2 * n + 1,
                "reduce_scatter": 0,
                "all_gather": 0,
                "fused_all_gather_matmul": 0,
                "fused_matmul_reduce_scatter": 0,
            }
        if not fused:
            return {
                "all_reduce": 1,
                "reduce_scatter": 2 * n,
                "all_gather": 2 * n,
                "fused_all_gather_matmul": 0,
                "fused_matmul_reduce_scatter": 0,
            }
        return {
            "all_reduce": 1,
            "reduce_scatter": 0,
            "all_gather": 0,
            "fused_all_gather_matmul": 2 * n,
            "fused_matmul_reduce_scatter": 2 * n,
        }


class StandInCompiled:
    def __init__(self, model: StandInModel, config: LabConfig, break_fusion: bool = False):
        self.model = model
        self.report = StandInReport(config, model.spec.num_layers, break_fusion)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)


def stand_in_compile(model, config):
    return StandInCompiled(model, config)


def compile_without_fusion(model, config):
    """A compiler whose AsyncTP pass silently does nothing (the failure the flag exists for)."""
    return StandInCompiled(model, config, break_fusion=True)


class StopAfter(Exception):
    pass


def stop_after(k: int):
    """An on_row callback that interrupts the sweep after k rows (rows are on disk by then)."""
    seen = []

    def on_row(row):
        seen.append(row)
        if len(seen) >= k:
            raise StopAfter(f"interrupted after {k} rows")

    return on_row


def sweep_two_ranks(store_dir, **kwargs):
    return launch_sweep(
        "stand-in",
        world_size=2,
        backend="gloo",
        timeout=120.0,
        store_dir=store_dir,
        build_fn=stand_in_build,
        compile_fn=kwargs.pop("compile_fn", stand_in_compile),
        warmup=1,
        repeats=3,
        progress=False,
        config=LabConfig(tp_size=2, async_tp_min_tokens=16),
        **kwargs,
    )


# ------------------------------------------------------------------------------------------------ variants
def test_variant_configs_are_what_their_names_say():
    base = LabConfig(tp_size=2, async_tp_min_tokens=256, boundary="gather")
    assert not variant_config("baseline", base).enable_sp
    sp = variant_config("sp", base)
    assert sp.enable_sp and not sp.enable_async_tp and sp.async_tp_min_tokens == 1
    both = variant_config("sp+async_tp", base)
    assert both.enable_sp and both.enable_async_tp and both.async_tp_min_tokens == 1
    assert variant_config("tuned", base) == base
    assert all(variant_config(v, base).boundary == "gather" for v in ("baseline", "sp", "tuned"))
    assert base.async_tp_min_tokens == 256  # the caller's config is untouched
    with pytest.raises(ValueError, match="unknown variant 'fast'.*baseline"):
        variant_config("fast", base)


def test_expectation_follows_the_configs_gate():
    tuned = LabConfig(tp_size=2, async_tp_min_tokens=128)
    assert not expectation(tuned, 64).fusion and not expectation(tuned, 64).sp
    assert "gated off" in expectation(tuned, 64).note
    assert expectation(tuned, 128).fusion and expectation(tuned, 128).sp
    assert not expectation(dataclasses.replace(tuned, tp_size=1), 512).fusion


# ------------------------------------------------------------------------------------------------ one rank
def test_single_process_sweep_without_process_group(tmp_path):
    """tp=1 runs in the calling process (no launch): rows are written and nothing is 'expected'."""
    result = run_sweep(
        "stand-in",
        token_counts=[2, 8],
        store_dir=tmp_path,
        config=LabConfig(tp_size=1),
        variants=["baseline", "sp+async_tp"],
        warmup=0,
        repeats=2,
        progress=False,
        build_fn=stand_in_build,
        compile_fn=stand_in_compile,
    )
    df = SweepStore(tmp_path).read()
    assert df.height == 4 == len(result.rows)
    assert df["backend"].unique().to_list() == ["none"] and df["tp"].unique().to_list() == [1]
    assert not df["fusion_missing"].any()  # tp=1: SP has nothing to rewrite, so none is missing


def test_a_sweep_result_reads_in_one_line():
    """The last expression of a notebook cell: the dataclass's own repr spelled out every row (40 lines)."""
    from sp_lab.bench.progress import SweepTally

    rows = [{"num_tokens": t, "variant": "sp", "fusion_missing": t == 16} for t in range(1, 41)]
    result = SweepResult(rows=rows, skipped=4, store_dir="out/sweeps", sweep_id="s1")
    assert repr(result) == ("SweepResult(40 rows measured now, 4 points reused, fusion missing in 1; "
                            "sweep s1 in out/sweeps)")
    counted = dataclasses.replace(result, tally=SweepTally(total=44, measured=44))
    assert repr(counted) == "SweepResult(44 of 44 points measured now, fusion missing in 1; sweep s1 in out/sweeps)"


def test_bad_arguments_are_named():
    common = {
        "store_dir": "unused",
        "build_fn": stand_in_build,
        "compile_fn": stand_in_compile,
        "progress": False,
    }
    with pytest.raises(ValueError, match="tp_size=2 but the process group has world_size=1"):
        run_sweep("stand-in", token_counts=[1], tp_size=2, **common)
    with pytest.raises(ValueError, match=r"token counts must be positive ints, got \[0\]"):
        run_sweep("stand-in", token_counts=[0, 4], **common)
    with pytest.raises(ValueError, match="unknown or no variants"):
        run_sweep("stand-in", token_counts=[1], variants=["sp", "turbo"], **common)
    with pytest.raises(ValueError, match="exceed config.max_num_tokens=8"):
        run_sweep(
            "stand-in",
            token_counts=[4, 16],
            config=LabConfig(tp_size=1, max_num_tokens=8, async_tp_min_tokens=4),
            **common,
        )
    with pytest.raises(ValueError, match="dtype='float33'"):
        run_sweep("stand-in", token_counts=[1], dtype="float33", config=LabConfig(tp_size=1), **common)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"dtype": "float33"}, SweepArgumentError, "dtype='float33' is not a model dtype"),
    ({"repeats": 5, "max_repeats": 2}, SweepArgumentError, "need max_repeats >= repeats"),
    ({"ci_width": 0.0}, SweepArgumentError, "ci_width > 0"),
    ({"warmup": -1}, SweepArgumentError, "need warmup >= 0 and repeats >= 1, got warmup=-1"),
    ({"token_counts": [4, 64]}, SweepArgumentError, r"token counts \[64\] exceed config.max_num_tokens=32"),
    ({"tp_size": 4}, SweepArgumentError, "tp_size=4 but world_size=2: TP spans the whole group; pass world_size=4"),
    ({"variants": ["sp", "turbo"]}, SweepArgumentError, "unknown or no variants"),
    ({"repeat": 3}, TypeError, r"launch_sweep: unknown arguments \['repeat'\]"),
])
def test_launch_refuses_what_every_rank_would_before_starting_them(kwargs, error, message, monkeypatch):
    """The ranks' own checks, run once here: a bad argument never starts ranks that would all fail with it."""
    from sp_lab.distributed import launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("ranks were started"))
    args = {"token_counts": [4], "config": LabConfig(tp_size=2, max_num_tokens=32, async_tp_min_tokens=4),
            "build_fn": stand_in_build, "progress": False, **kwargs}
    with pytest.raises(error, match=message):
        launch_sweep("stand-in", world_size=2, store_dir="unused", **args)


def test_a_rehearsal_sweep_skips_a_point_another_rehearsal_sweep_measured_meanwhile(tmp_path):
    """The claim's re-check counts rows of the sweep's own source, as its plan does: rehearsal rows for ranks
    sharing one GPU (a re-check by measured rows only would measure the point twice)."""
    from test_store import make_row

    from sp_lab.bench.sweep import _claim_or_skip, _plan_points, _Progress, config_hash

    store, cfg = SweepStore(tmp_path), LabConfig(tp_size=2)
    row = make_row(8, source="rehearsal", variant="sp", boundary=cfg.boundary, config_hash=config_hash(cfg))
    base = {c: row[c] for c in KEY_COLUMNS if c not in ("variant", "boundary", "num_tokens", "config_hash")}
    seen = set(store.parts())
    plan = _plan_points(store, {**base, "source": "rehearsal"}, {"sp": cfg}, [8], rank=0)
    assert plan.pending == {8: ["sp"]}
    store.append([row])  # another rehearsal sweep of the store measured the point after this one planned
    progress = _Progress(store, "s", plan.tally, enabled=False, rank=0)
    claims, claimed = _claim_or_skip(store, plan, 8, ["sp"], seen, progress, rank=0)
    assert claims == {} and claimed == [] and progress.elsewhere == 1


# ------------------------------------------------------------------------------------------------ two ranks
def test_two_rank_sweep_rows_have_full_provenance_then_resume_after_interruption(tmp_path):
    store_dir = tmp_path / "sweeps"
    streamed = []

    # 1) interrupted: rank 0's on_row raises after 5 rows (run_sweep inside the ranks, no watcher)...
    with pytest.raises(RankError, match="interrupted after 5 rows"):
        sp_lab.launch(
            run_sweep,
            "stand-in",
            world_size=2,
            backend="gloo",
            timeout=120.0,
            store_dir=store_dir,
            token_counts=TOKENS,
            variants=["baseline", "sp", "sp+async_tp"],
            build_fn=stand_in_build,
            compile_fn=stand_in_compile,
            warmup=1,
            repeats=3,
            progress=False,
            config=LabConfig(tp_size=2, async_tp_min_tokens=16),
            on_row=stop_after(5),
        )
    first = SweepStore(store_dir).read()
    assert first.height == 5  # ...but every row measured before the failure is on disk

    # 2) resumed: measures only the 7 missing points, loses nothing, duplicates nothing
    tallies = []
    result = sweep_two_ranks(
        store_dir, token_counts=TOKENS, variants=["baseline", "sp", "sp+async_tp"], on_row=streamed.append,
        on_tally=tallies.append,
    )
    assert result.skipped == 5 and len(result.rows) == 7
    assert len(streamed) == 7  # the parent's watcher saw each new row
    # ... and told the reused points and where from, from the first count it saw to the last
    from sp_lab.bench.setups import describe_timestamp

    when = describe_timestamp(first["timestamp"].max())
    assert tallies[0].reused == 5 and tallies[0].total == 12 and tallies[0].measured < 7
    assert tallies[-1].describe() == result.tally.describe() == f"5 of 12 points from the sweep of {when}, 7 measured now"
    df = SweepStore(store_dir).read()
    assert df.height == 12
    assert df.select(KEY_COLUMNS).is_unique().all()
    assert set(first["row_id"]) <= set(df["row_id"])

    # provenance: every column but the free-text note is set on every row
    required = [c for c in ROW_SCHEMA if c not in NULLABLE_COLUMNS]
    nulls = {c: n for c, n in df.select(pl.col(required).null_count()).row(0, named=True).items() if n}
    assert not nulls, f"null provenance columns: {nulls}"
    row = df.row(0, named=True)
    assert row["tp"] == 2 and row["backend"] == "gloo" and row["device_count"] == 1
    assert row["source"] == "measured" and row["torch_version"] == torch.__version__
    assert row["device_name"].startswith("cpu") and row["timing_method"] == "perf_counter"
    assert (df["latency_us"] > 0).all()
    # every row carries its interval, and the median lies in it
    assert ((df["ci_low_us"] <= df["latency_us"]) & (df["latency_us"] <= df["ci_high_us"])).all()

    # 3) nothing left to do: no compile, no rows
    again = sweep_two_ranks(store_dir, token_counts=TOKENS, variants=["baseline", "sp", "sp+async_tp"])
    assert again.skipped == 12 and again.rows == []


def test_fusion_that_did_not_fire_is_flagged_not_reported_as_the_variant(tmp_path):
    result = sweep_two_ranks(
        tmp_path, token_counts=[4, 32], variants=["sp+async_tp", "tuned"], compile_fn=compile_without_fusion
    )
    df = SweepStore(tmp_path).read().sort("variant", "num_tokens")
    by = {(r["variant"], r["num_tokens"]): r for r in df.iter_rows(named=True)}
    # sp+async_tp expects fusion everywhere; tuned (min 16) only at 32 tokens
    assert by[("sp+async_tp", 4)]["fusion_missing"] and by[("sp+async_tp", 32)]["fusion_missing"]
    assert by[("tuned", 32)]["fusion_missing"]
    assert not by[("tuned", 4)]["fusion_missing"]  # gated off on purpose: nothing is missing
    assert by[("tuned", 32)]["reported_variant"] == "tuned" + FUSION_MISSING_SUFFIX
    assert by[("tuned", 4)]["reported_variant"] == "tuned"
    assert "did not fire" in by[("sp+async_tp", 4)]["note"]
    assert len(result.fusion_missing) == 3


class SlowCompiled(StandInCompiled):
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        time.sleep(0.01)  # slow enough that the kill lands mid-sweep
        return super().__call__(input_ids)


def slow_compile(model, config):
    return SlowCompiled(model, config)


_KILLED_SWEEP = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    from test_sweep import TOKENS, slow_compile, sweep_two_ranks
    sweep_two_ranks(sys.argv[1], token_counts=TOKENS, variants=["baseline", "sp", "sp+async_tp"],
                    compile_fn=slow_compile)
    """
)


def test_sweep_killed_with_sigkill_resumes_without_losing_or_repeating_rows(tmp_path):
    """SIGKILL the process that launched the ranks (they die with it); a rerun finishes the job."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SWEEP, str(tmp_path), str(Path(__file__).parent)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    store = SweepStore(tmp_path)
    deadline = time.monotonic() + 60
    while len(store.parts()) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    before = store.read()
    assert 3 <= before.height < 12, "the kill should land part-way through the sweep"

    result = sweep_two_ranks(tmp_path, token_counts=TOKENS, variants=["baseline", "sp", "sp+async_tp"])
    after = store.read()
    # rows killed in flight were never on disk; every row that was is kept and not measured again
    assert result.skipped + len(result.rows) == 12 and result.skipped >= before.height
    assert after.height == 12 and after.select(KEY_COLUMNS).is_unique().all()
    assert set(before["row_id"]) <= set(after["row_id"])


# ------------------------------------------------------------------------------------------------ timing
def test_time_cpu_reports_median_and_deciles_of_the_timed_calls():
    calls = []
    timing = time_cpu(lambda: (calls.append(1), time.sleep(0.002)), warmup=2, repeats=5)
    assert len(calls) == 7 and timing.repeats == 5 and timing.method == "perf_counter"
    assert 2000 <= timing.p10_us <= timing.median_us <= timing.p90_us < 200_000
    with pytest.raises(ValueError, match="repeats >= 1"):
        time_cpu(lambda: None, repeats=0)


def test_several_calls_per_sample_give_per_call_times():
    calls = []
    timing = time_cpu(lambda: (calls.append(1), time.sleep(0.002)), warmup=1, repeats=3, calls=4)
    assert len(calls) == 1 + 3 * 4 and timing.repeats == 3
    assert 2000 <= timing.median_us < 8000  # per call, not per sample of four (>= 8 ms)
    with pytest.raises(ValueError, match="calls per sample must be >= 1, got 0"):
        time_cpu(lambda: None, calls=0)


def _rank_timing():
    """One launch, two checks: rank 1 is the straggler in a plain timing and in interleaved rounds."""
    from sp_lab.bench.interleave import StopRule, interleave

    # the step's latency is the straggler's median, not the average
    timing = reduce_across_ranks(time_cpu(lambda: time.sleep(0.001 + 0.004 * dist.get_rank()), warmup=0, repeats=3))
    # interleaved rounds: rank 0's call takes 1 ms, rank 1's at least 20 ms; every recorded call is the step's
    stop = StopRule(repeats=4, max_repeats=4, ci_width=1e-9, budget_s=None, points_left=1)
    rounds = interleave({"v": lambda: time.sleep(0.001 + 0.019 * dist.get_rank())}, device=torch.device("cpu"),
                        warmup=0, cuda_graph=False, stop=stop)
    # ranks that timed differently (rank 0 replayed a CUDA graph, rank 1 fell back to eager calls, saying why)
    import sp_lab.bench.interleave as interleave_module

    class Fallback(interleave_module.CallSampler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if dist.get_rank() == 0:
                self.method = "cuda_graph"
            else:
                self.note = "rank 1: graph capture failed"

    real, interleave_module.CallSampler = interleave_module.CallSampler, Fallback
    try:
        stop = StopRule(repeats=2, max_repeats=2, ci_width=1e-9, budget_s=None, points_left=1)
        mixed = interleave({"v": lambda: None}, device=torch.device("cpu"), warmup=0, cuda_graph=False, stop=stop)
    finally:
        interleave_module.CallSampler = real
    return timing, rounds["v"].samples_us, (mixed["v"].method, mixed["v"].note)


def test_latency_across_ranks_is_the_slowest_ranks_median():
    (r0, samples0, mixed0), (r1, samples1, mixed1) = sp_lab.launch(_rank_timing, world_size=2, backend="gloo",
                                                                   timeout=60.0)
    assert r0 == r1  # every rank gets the same answer
    assert r0.median_us == max(r0.rank_medians_us) == r0.rank_medians_us[1] >= 5000
    assert r0.rank_medians_us[0] < 5000
    # interleaved sweeps keep the slowest rank's time of every call (rank 1 sleeps >= 20 ms), on every rank
    assert samples0 == samples1 and len(samples0) == 4
    assert min(samples0) >= 20_000, f"a recorded call is faster than the slowest rank: {samples0}"
    # a row is timed as its weakest rank was, and says why, on every rank
    assert mixed0 == mixed1 and mixed0[0] == "perf_counter" and "rank 1: graph capture failed" in mixed0[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_time_cuda_replays_a_graph_and_falls_back_when_capture_fails():
    a = torch.randn(1024, 1024, device="cuda")
    graphed = time_cuda(lambda: a @ a, warmup=2, repeats=10)
    assert graphed.method == "cuda_graph" and graphed.median_us > 0 and not graphed.note
    # .item() syncs with the host, which a CUDA graph cannot capture
    eager = time_cuda(lambda: (a @ a).sum().item(), warmup=1, repeats=5)
    assert eager.method == "cuda_events" and "capture failed" in eager.note
    torch.randn(4, device="cuda")  # the failed capture left the CUDA generator usable
    assert time_fn(lambda: a @ a, device="cuda", repeats=3).method == "cuda_graph"
    # several calls in one graph: per-call time, about the single call's
    per_call = time_cuda(lambda: a @ a, warmup=2, repeats=10, calls=20, barrier=False)
    assert per_call.method == "cuda_graph" and 0.3 * graphed.median_us < per_call.median_us < 3 * graphed.median_us


# ------------------------------------------------------------------------------------------------ interleaving
class RecordingCompiled(StandInCompiled):
    """Appends (variant, token count) to a shared log on every call, to see the order of measurement."""

    log: typing.ClassVar[list] = []

    def __init__(self, model, config, variant):
        super().__init__(model, config)
        self.variant = variant

    def __call__(self, input_ids):
        RecordingCompiled.log.append((self.variant, int(input_ids.shape[0])))
        return super().__call__(input_ids)


def test_variants_are_interleaved_in_rotating_order_per_token_count(tmp_path):
    names = iter(["baseline", "sp", "sp+async_tp"])
    RecordingCompiled.log = []
    result = run_sweep("stand-in", token_counts=[2, 8], store_dir=tmp_path, config=LabConfig(tp_size=1),
                       variants=["baseline", "sp", "sp+async_tp"], warmup=0, repeats=4, max_repeats=4,
                       progress=False, build_fn=stand_in_build,
                       compile_fn=lambda model, cfg: RecordingCompiled(model, cfg, next(names)))
    assert len(result.rows) == 6 and all(r["repeats"] == 4 for r in result.rows)
    at_2 = [v for v, t in RecordingCompiled.log if t == 2][3:]  # after one untimed first call each
    # round 0: b, s, f; round 1: s, f, b; round 2: f, b, s; ... (no variant measured in a block)
    assert at_2[:9] == ["baseline", "sp", "sp+async_tp", "sp", "sp+async_tp", "baseline",
                        "sp+async_tp", "baseline", "sp"]
    assert max(t for _, t in RecordingCompiled.log[:len(RecordingCompiled.log) // 2]) == 2  # 2 done before 8


class _FakeClock:
    """``time.monotonic`` for the interleaving loop only: each stand-in call advances it by ``step`` seconds."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def monotonic(self) -> float:
        return self.now

    def compile(self, model, config):
        clock = self

        class Ticking(StandInCompiled):
            def __call__(self, input_ids):
                clock.now += clock.step
                return super().__call__(input_ids)

        return Ticking(model, config)


def test_the_time_budget_is_shared_by_the_token_counts(tmp_path, monkeypatch):
    """4 token counts, a 1 s budget and calls that take 10 ms (on a fake clock): each token count gets 0.25 s,
    25 rounds, however fast the machine; without sharing the first would take all 100."""
    from sp_lab.bench import interleave

    clock = _FakeClock(0.01)
    monkeypatch.setattr(interleave, "time", clock)
    result = run_sweep("stand-in", token_counts=[2, 4, 8, 16], store_dir=tmp_path, config=LabConfig(tp_size=1),
                       variants=["baseline"], warmup=0, repeats=2, max_repeats=100_000, ci_width=1e-9, budget_s=1.0,
                       progress=False, build_fn=stand_in_build, compile_fn=clock.compile)
    repeats = {r["num_tokens"]: r["repeats"] for r in result.rows}
    assert sorted(repeats) == [2, 4, 8, 16]
    assert all(24 <= n <= 26 for n in repeats.values()), f"rounds per token count: {repeats}"
    assert all("time budget spent" in r["note"] for r in result.rows)


def test_rounds_stop_when_the_intervals_are_narrow_or_the_budget_ends(tmp_path):
    common = {"token_counts": [4], "config": LabConfig(tp_size=1), "variants": ["baseline"], "warmup": 2,
              "progress": False, "build_fn": stand_in_build, "compile_fn": stand_in_compile}
    # Any interval is narrow enough: the sweep stops at `repeats`. (A finite width was flaky: over 6 samples the
    # 95% interval is (min, max), and one preempted call of a microsecond stand-in is 100x the median.)
    loose = run_sweep("stand-in", store_dir=tmp_path / "a", repeats=6, max_repeats=500, ci_width=math.inf, **common)
    assert loose.rows[0]["repeats"] == 6 and "intervals within" in loose.rows[0]["note"]
    tight = run_sweep("stand-in", store_dir=tmp_path / "b", repeats=6, max_repeats=100_000, ci_width=1e-9,
                      budget_s=2.0, **common)
    assert tight.rows[0]["repeats"] > 6 and "time budget spent" in tight.rows[0]["note"]
    with pytest.raises(ValueError, match="need max_repeats >= repeats"):
        run_sweep("stand-in", store_dir=tmp_path / "c", repeats=6, max_repeats=2, **common)



def test_a_sweep_of_fewer_than_six_rounds_stores_no_interval(tmp_path):
    """The range of fewer than 6 calls is no 95% interval: the rounds do not stop on it and the row stores none."""
    store_dir = tmp_path / "s"
    result = run_sweep("stand-in", store_dir=store_dir, token_counts=[4], config=LabConfig(tp_size=1),
                       variants=["baseline"], warmup=0, repeats=3, max_repeats=5, ci_width=math.inf, progress=False,
                       build_fn=stand_in_build, compile_fn=stand_in_compile)
    row = result.rows[0]
    assert row["repeats"] == 5 and "max_repeats=5 reached" in row["note"] and "intervals within" not in row["note"]
    stored = SweepStore(store_dir).read()
    assert stored["ci_low_us"].to_list() == [None] and stored["ci_high_us"].to_list() == [None]

def test_the_stop_rule_reads_the_intervals_of_every_variant():
    """The decision itself, on given samples (deterministic): narrow intervals stop, one wide variant goes on."""
    from sp_lab.bench.interleave import StopRule

    rule = StopRule(repeats=6, max_repeats=8, ci_width=0.10, budget_s=None, points_left=1)
    narrow = [100.0, 101.0, 99.0, 100.0, 102.0, 98.0]  # 6 samples: the interval is (98, 102), 4% of 100
    wide = [100.0, 300.0, 100.0, 300.0, 100.0, 300.0]  # (100, 300): 100% of its median 200
    assert rule.reason({"a": narrow[:5], "b": narrow[:5]}, 0.0, None) is None  # fewer than `repeats`
    assert "intervals within 10% of the medians after 6 rounds" in rule.reason({"a": narrow, "b": narrow}, 0.0, None)
    assert rule.reason({"a": narrow, "b": wide}, 0.0, None) is None
    assert "time budget spent" in rule.reason({"a": narrow, "b": wide}, 1.5, 1.0)
    assert "max_repeats=8 reached" in rule.reason({"a": narrow + [100.0] * 2, "b": wide + [100.0, 300.0]}, 0.0, None)


# ------------------------------------------------------------------------------------------------ real compiler
@pytest.fixture(scope="module")
def real_toy_run(tmp_path_factory) -> Path:
    """The toy model through sp_lab.compile on two gloo ranks: baseline and sp+async_tp at 3 and 16 tokens. The
    directory holds the store (``sweeps``) and the variants' compile reports (``reports``)."""
    run = tmp_path_factory.mktemp("real")
    launch_sweep("toy", world_size=2, backend="gloo", timeout=600.0, store_dir=run / "sweeps", token_counts=[3, 16],
                 variants=["baseline", "sp+async_tp"], config=LabConfig(tp_size=2), warmup=0, repeats=2,
                 max_repeats=2, progress=False, reports_dir=run / "reports")
    return run


@pytest.fixture(scope="module")
def real_toy_sweep(real_toy_run):
    return SweepStore(real_toy_run / "sweeps").read().sort("variant", "num_tokens")


def test_a_sweeps_variants_share_one_dynamo_capture(real_toy_run):
    reports = {path.stem: CompileReport.from_json(path.read_text()) for path in (real_toy_run / "reports").glob("*.json")}
    assert sorted(reports) == ["baseline", "sp+async_tp"]
    graphs = sorted((g.shared_capture, g.capture_time_s > 0) for r in reports.values() for g in r.graphs)
    # One variant captured the forward (1-D tokens: one signature for 3 and 16), the other compiled from it.
    assert graphs == [(False, True), (True, False)], graphs


def test_a_real_sweep_records_the_fused_ops_the_compiler_emitted(real_toy_sweep):
    from sp_lab.models.toy import toy_config

    layers = toy_config().num_layers
    by = {(r["variant"], r["num_tokens"]): r for r in real_toy_sweep.iter_rows(named=True)}
    assert len(by) == 4 and not real_toy_sweep["fusion_missing"].any()
    for t in (3, 16):
        base, fused = by[("baseline", t)], by[("sp+async_tp", t)]
        # baseline: an all_reduce after the vocab-parallel embedding and after each row-parallel matmul
        # (o_proj, down), nothing rewritten
        assert (base["sp_rewrites"], base["n_fused_ag_mm"], base["n_fused_mm_rs"]) == (0, 0, 0)
        assert base["n_all_reduce"] == 2 * layers + 1 and not base["fusion_fired"]
        # sp+async_tp: every all_reduce rewritten; each gather fused into the next column-parallel matmul
        # (qkv, gate_up per layer, the lm_head), each reduce_scatter into the row-parallel matmul before it
        # (o_proj, down); the embedding's reduce_scatter has no matmul to fuse with
        assert fused["sp_rewrites"] == 2 * layers + 1 and fused["fusion_fired"]
        assert (fused["n_fused_ag_mm"], fused["n_fused_mm_rs"]) == (2 * layers + 1, 2 * layers)
        assert (fused["n_all_reduce"], fused["n_reduce_scatter"]) == (0, 1)


# ------------------------------------------------------------------------------------------------ first point sooner
class CompilingCompiled(RecordingCompiled):
    """Compiles a range on its first call at a count in it, like CompiledModel (``pending_compile``), and logs
    ``("compile", variant, T, what the store's progress said)`` for it."""

    store: typing.ClassVar[SweepStore | None] = None
    sweep_id: typing.ClassVar[str] = ""

    def __init__(self, model, config, variant):
        super().__init__(model, config, variant)
        self.compiled: set[tuple[int, int]] = set()

    def pending_compile(self, num_tokens):
        lo, hi = self.report.config.range_for(num_tokens)
        rng = CompileRange(lo, hi, enable_sp=False, enable_async_tp=False)
        return None if (lo, hi) in self.compiled else rng

    def __call__(self, input_ids):
        t = int(input_ids.shape[0])
        if self.pending_compile(t) is not None:
            self.compiled.add(self.report.config.range_for(t))
            said = CompilingCompiled.store.plan_doing(CompilingCompiled.sweep_id)
            RecordingCompiled.log.append(("compile", self.variant, t, said))
        return super().__call__(input_ids)


def test_a_variant_is_measured_as_soon_as_it_is_compiled_and_the_bar_says_what_compiles(tmp_path):
    names = iter(["baseline", "sp", "sp+async_tp"])
    RecordingCompiled.log = []
    CompilingCompiled.store, CompilingCompiled.sweep_id = SweepStore(tmp_path), "first-point"
    rows_at: list[int] = []
    config = LabConfig(tp_size=1, async_tp_min_tokens=8, max_num_tokens=64)  # ranges [1, 7] and [8, 64]
    result = run_sweep("stand-in", token_counts=[2, 4], store_dir=tmp_path, config=config, sweep_id="first-point",
                       variants=["baseline", "sp", "sp+async_tp"], warmup=0, repeats=3, max_repeats=3,
                       progress=False, build_fn=stand_in_build, on_row=lambda row: rows_at.append(len(RecordingCompiled.log)),
                       compile_fn=lambda model, cfg: CompilingCompiled(model, cfg, next(names)))
    log = RecordingCompiled.log
    compiles = [(i, entry) for i, entry in enumerate(log) if entry[0] == "compile"]
    # One compile per variant, all at the first point; each said on the progress line while it ran.
    assert [(v, t) for _, (_, v, t, _) in compiles] == [("baseline", 2), ("sp", 2), ("sp+async_tp", 2)]
    # baseline keeps the threshold's split; the SP variants run their program from 1 token: one range.
    assert [said for _, (*_, said) in compiles] == [
        "compiling baseline [1, 7] for T=2", "compiling sp [1, 64] for T=2", "compiling sp+async_tp [1, 64] for T=2"]
    # The first row is on disk before the second variant compiles, the second before the third.
    assert rows_at[0] <= compiles[1][0] and rows_at[1] <= compiles[2][0]
    # At 4 tokens every variant's range is compiled: measured together, interleaved in rotating order.
    at_4 = [v for v, t in (e for e in log if e[0] != "compile") if t == 4][3:]
    assert at_4[:6] == ["baseline", "sp", "sp+async_tp", "sp", "sp+async_tp", "baseline"]
    assert len(result.rows) == 6


# ------------------------------------------------------------------------------------------------ reused points
def test_a_rerun_counts_the_points_it_reuses_and_from_which_sweep_in_its_bar_and_result(tmp_path, capsys):
    """A rerun over 3 token counts x 2 variants whose store holds 2 of the counts: the bar starts at 4 of 6 (not at 0
    of 2) and says where the 4 come from; the result and the plan file a watcher reads say the same."""
    from sp_lab.bench.progress import SweepTally
    from sp_lab.bench.setups import describe_timestamp

    common = {"store_dir": tmp_path, "config": LabConfig(tp_size=1), "variants": ["baseline", "sp+async_tp"],
              "warmup": 0, "repeats": 2, "build_fn": stand_in_build, "compile_fn": stand_in_compile}
    first = run_sweep("stand-in", token_counts=[2, 4], progress=False, **common)
    assert first.tally == SweepTally(total=4, measured=4)
    assert first.tally.describe() == "4 of 4 points measured now"
    when = describe_timestamp(SweepStore(tmp_path).read()["timestamp"].max())
    capsys.readouterr()
    plans = []
    again = run_sweep("stand-in", token_counts=[2, 4, 8], progress=True, sweep_id="again",
                      on_row=lambda row: plans.append(SweepStore(tmp_path).plan_tally("again")), **common)
    said = f"4 of 6 points from the sweep of {when}, 2 measured now"
    assert again.tally.describe() == said and again.skipped == 4 and len(again.rows) == 2
    assert [o.sweep_id for o in again.tally.origins] == [first.sweep_id]
    bar = capsys.readouterr().err.replace("\r", "\n")
    assert "4/6" in bar and "6/6" in bar and " 0/6" not in bar and " 0/2" not in bar
    assert f"4 of 6 points from the sweep of {when}, 0 of 2 measured now" in bar
    assert said in bar
    # what launch_sweep's watcher (the notebook's bar, the tuner) reads from the store while the ranks run
    assert SweepTally.from_dict(plans[0]).reused == 4 and SweepTally.from_dict(plans[0]).total == 6
