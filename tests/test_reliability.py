"""Reliability and safety: injected faults mid-sweep, concurrent sweeps, hostile and malformed inputs.

The whole picture of what is covered, and where (this file fills the gaps; nothing is tested twice):

=================================== ==================================================================
fuzzed equivalence                  ``tests/test_fuzz_equivalence.py`` (CI profile + ``-m slow`` long profile)
a rank that raises / is SIGKILLed / ``tests/test_launch.py``: plain ``sp_lab.launch`` -- error names rank,
hangs; Ctrl-C; no orphans           signal, traceback, stack; process trees killed; ranks die with a killed
                                    caller. **Here**: the same faults *mid-sweep* through ``launch_sweep``
                                    (the notebook API): error, rank pids gone, rows kept, resume.
sweep interrupted, resumed;         ``tests/test_sweep.py``: rank 0's ``on_row`` raising inside the ranks;
caller SIGKILLed mid-sweep          the caller process SIGKILLed. **Here**: the notebook kernel interrupted
                                    (SIGINT in the caller) mid-sweep.
truncated / corrupt part files      ``tests/test_store.py``: ``CorruptPartError`` naming the part,
                                    quarantine. **Here**: a part truncated *during* a sweep, then resumed.
two concurrent writers              ``tests/test_store.py``: two processes appending rows. **Here**: two
                                    whole sweeps (2 ranks each) on one store, each streaming only its rows.
pickle checkpoints refused          ``tests/test_checkpoint.py`` (a benign ``torch.save``). **Here**: a
                                    malicious pickle is never unpickled by any loader (a canary file).
malformed LabConfig / MatmulRule    ``tests/test_config.py``, ``tests/test_rules.py`` (wrong types, unknown
                                    fields, bad JSON). **Here**: code in rule fields, pickle/binary
                                    payloads, CompileReport and saved-report files, store parts of a
                                    foreign schema, no code-executing loader anywhere in ``sp_lab``.
JupyterLab on loopback with token   **Here**: the Makefile's ``lab`` command, started for real.
=================================== ==================================================================

Every fault test asserts the four promises of the issue: a clear error in the caller naming the rank and
the cause; no orphaned process (each rank's pid is recorded and must be gone, not just reparented); every
row measured before the fault still on disk; and the next run measures exactly the missing points.

The model and compiler are the stand-ins of ``tests/test_sweep.py`` (a real gloo all_reduce per layer,
microseconds per call): these tests are about the machinery, and the compiled path is fuzzed elsewhere.
Figures (faults injected, bad inputs tried, rows lost) are tallied in ``LEDGER`` and printed at the end of
the module (``pytest -s tests/test_reliability.py``).
"""

from __future__ import annotations

import ast
import collections
import contextlib
import functools
import json
import os
import pickle
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("plotly", reason="sp_lab.viz.explorer needs plotly (optional on GPU machines)")
from test_launch import _is_alive, _live_descendants, left_behind
from test_store import make_row
from test_sweep import StandInCompiled, stand_in_build

import sp_lab
from sp_lab.bench.store import (
    KEY_COLUMNS,
    QUARANTINE_DIR,
    ROW_SCHEMA,
    CorruptPartError,
    ForeignPartError,
    SweepStore,
    normalize_rows,
)
from sp_lab.bench.sweep import launch_sweep
from sp_lab.compiler.report import CompileReport, ReportError
from sp_lab.config import ConfigError, LabConfig
from sp_lab.distributed.launch import LaunchTimeout, RankError
from sp_lab.jsonfile import read_json
from sp_lab.models.checkpoint import CheckpointError
from sp_lab.rules import MatmulRule, RuleError
from sp_lab.viz.explorer import load_report

REPO = Path(__file__).resolve().parents[1]
TOKENS = [1, 4, 16, 64]
VARIANTS = ["baseline", "sp", "sp+async_tp"]
POINTS = len(TOKENS) * len(VARIANTS)
FAULT_AT = ("sp", 16)
"""(variant, token count) at whose first call rank 1 misbehaves: 4 baseline + 2 sp points are done by then."""
ROWS_BEFORE_FAULT = 6

LEDGER: collections.Counter = collections.Counter()
"""faults_injected, bad_inputs, rows_before_faults, rows_lost: the figures of the closing note."""


@pytest.fixture(scope="module", autouse=True)
def print_figures():
    yield
    print(
        f"\nreliability figures: {LEDGER['faults_injected']} faults injected, {LEDGER['bad_inputs']} bad inputs "
        f"tried, {LEDGER['rows_before_faults']} rows on disk before faults, {LEDGER['rows_lost']} rows lost"
    )


@pytest.fixture(autouse=True)
def no_leftover_processes():
    before = set(_live_descendants(os.getpid()))
    yield
    left = left_behind(before)
    assert not left, f"processes left behind: {sorted(left)}"


# ---------------------------------------------------------------------------------------------------------------
# Fault injection: a stand-in compiler whose model records its rank's pid and misbehaves on rank 1 at FAULT_AT


def _variant_of(config: LabConfig) -> str:
    if not config.enable_sp:
        return "baseline"
    return "sp+async_tp" if config.enable_async_tp else "sp"


class InstrumentedCompiled(StandInCompiled):
    """The stand-in compiled model of ``tests/test_sweep.py``, instrumented for fault injection.

    Records this rank's pid in ``pid_dir`` (to prove later that no rank survived), sleeps ``delay_s`` per call
    (so that an interrupt lands while points remain) and, on rank 1 at :data:`FAULT_AT`, injects ``fault``.
    """

    def __init__(self, model, config, *, fault: str | None, pid_dir: str | None, delay_s: float,
                 gate: str | None = None, call_log: str | None = None):
        super().__init__(model, config)
        self.fault, self.delay_s, self.variant = fault, delay_s, _variant_of(config)
        if pid_dir is not None:
            (Path(pid_dir) / f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
        if gate is not None:  # say this rank is ready, then wait until every rank of every sweep is
            Path(gate, f"ready-{os.getpid()}").touch()
            while not Path(gate, "go").exists():
                time.sleep(0.005)
        self.call_log = None if call_log is None else Path(f"{call_log}-rank{dist.get_rank()}")

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.fault and dist.get_rank() == 1 and (self.variant, input_ids.shape[0]) == FAULT_AT:
            inject_fault(self.fault)
        start = time.time()
        time.sleep(self.delay_s)
        out = super().__call__(input_ids)
        if self.call_log is not None:  # when this rank was busy calling the model: "start end" per call
            with open(self.call_log, "a") as log:
                log.write(f"{start} {time.time()}\n")
        return out


def inject_fault(fault: str) -> None:
    if fault == "sigkill":  # what the OOM killer does
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault == "raise":
        raise OSError(28, "injected fault: No space left on device")
    elif fault == "hang":
        while True:  # stuck outside any collective; the peer then waits in the next all_reduce
            time.sleep(0.05)
    raise ValueError(f"unknown fault {fault!r}")


def instrumented_compile(model, config, *, fault=None, pid_dir=None, delay_s=0.0, gate=None, call_log=None):
    return InstrumentedCompiled(model, config, fault=fault, pid_dir=pid_dir, delay_s=delay_s, gate=gate,
                                call_log=call_log)


def sweep(store_dir: Path, *, variants=VARIANTS, timeout: float = 60.0, on_row=None, progress=False,
          **compile_kwargs):
    """``launch_sweep`` of the stand-in over ``variants`` x ``TOKENS`` on 2 gloo ranks, from this process."""
    return launch_sweep(
        "stand-in",
        world_size=2,
        backend="gloo",
        timeout=timeout,
        store_dir=store_dir,
        token_counts=TOKENS,
        variants=variants,
        build_fn=stand_in_build,
        compile_fn=functools.partial(instrumented_compile, **compile_kwargs),
        warmup=1,
        repeats=3,
        progress=progress,
        on_row=on_row,
        config=LabConfig(tp_size=2, async_tp_min_tokens=16),
    )


def assert_ranks_gone(pid_dir: Path) -> None:
    """Both ranks recorded their pids; none may survive, not even reparented to init (an orphan the
    descendant check of ``no_leftover_processes`` could not see)."""
    pids = [int(p.read_text()) for p in sorted(pid_dir.glob("rank*.pid"))]
    assert len(pids) == 2, f"ranks did not record their pids: {pids}"
    deadline = time.monotonic() + 5.0
    while any(map(_is_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_is_alive, pids)), f"orphaned rank processes: {[p for p in pids if _is_alive(p)]}"


def assert_resumes(store_dir: Path, before: pl.DataFrame) -> None:
    """The next run measures exactly the points missing from ``before`` (the readable rows) and keeps them all."""
    result = sweep(store_dir)
    after = SweepStore(store_dir).read()
    assert (result.skipped, len(result.rows)) == (before.height, POINTS - before.height)
    assert after.height == POINTS and after.select(KEY_COLUMNS).is_unique().all()
    lost = set(before["row_id"]) - set(after["row_id"])
    LEDGER["rows_before_faults"] += before.height
    LEDGER["rows_lost"] += len(lost)
    assert not lost, f"{len(lost)} row(s) on disk before the fault were lost"


def pid_dir_in(tmp_path: Path) -> Path:
    (tmp_path / "pids").mkdir()
    return tmp_path / "pids"


# ---------------------------------------------------------------------------------------------------------------
# Injected faults, mid-sweep


@pytest.mark.parametrize(
    ("fault", "cause"),
    [
        ("sigkill", r"rank 1 was killed by signal SIGKILL"),
        ("raise", r"rank 1 raised OSError: \[Errno 28\] injected fault: No space left on device"),
    ],
)
def test_a_rank_that_dies_mid_sweep_is_named_and_the_sweep_resumes(tmp_path, fault, cause):
    store_dir, pid_dir = tmp_path / "store", pid_dir_in(tmp_path)
    streamed: list[dict] = []
    LEDGER["faults_injected"] += 1
    with pytest.raises(RankError, match=cause) as info:
        sweep(store_dir, fault=fault, pid_dir=str(pid_dir), on_row=streamed.append)
    assert info.value.rank == 1
    if fault == "sigkill":
        assert info.value.signal == signal.SIGKILL and info.value.traceback is None
    else:
        assert "inject_fault" in info.value.traceback  # where, from the rank's own traceback
    assert_ranks_gone(pid_dir)

    before = SweepStore(store_dir).read()
    # Rank 0 appends a point only after both ranks have timed it: exactly the points before the fault are there,
    # and the caller heard of each of them (on_row) before the error reached it.
    assert before.height == ROWS_BEFORE_FAULT
    assert sorted(r["row_id"] for r in streamed) == sorted(before["row_id"])
    assert_resumes(store_dir, before)


def test_a_rank_that_hangs_mid_sweep_times_out_naming_it_and_the_sweep_resumes(tmp_path):
    store_dir, pid_dir = tmp_path / "store", pid_dir_in(tmp_path)
    LEDGER["faults_injected"] += 1
    # The deadline must leave room for the ranks to start and measure the six points before the fault:
    # ~3 s on an idle 2-core box, far more on a loaded one. Scaled by how long two bare ranks take to start
    # here and now, so the hang, not a slow start, is what times out.
    started = time.monotonic()
    sp_lab.launch(int, world_size=2, backend="gloo", timeout=300.0)
    timeout = 12.0 + 4 * (time.monotonic() - started)
    started = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        sweep(store_dir, fault="hang", pid_dir=str(pid_dir), timeout=timeout)
    elapsed = time.monotonic() - started
    error = info.value
    # Rank 0 is stuck too (in the all_reduce, waiting for rank 1); the stacks in the message say who is where.
    assert 1 in error.ranks and f"timed out after {timeout:g} s" in str(error)
    assert "inject_fault" in error.stacks[1] and "inject_fault" in str(error)
    assert "inject_fault" not in error.stacks.get(0, "")
    assert elapsed < timeout + 10.0  # deadline + stack dump + SIGTERM grace; never gloo's own 30-minute default
    assert_ranks_gone(pid_dir)

    before = SweepStore(store_dir).read()
    assert before.height == ROWS_BEFORE_FAULT
    assert_resumes(store_dir, before)


def test_interrupting_the_notebook_kernel_mid_sweep_stops_the_ranks_and_the_sweep_resumes(tmp_path, ctrl_c_raises):
    """Jupyter's "interrupt kernel" is a SIGINT to the kernel process: here, the caller of launch_sweep."""
    store_dir, pid_dir = tmp_path / "store", pid_dir_in(tmp_path)
    streamed: list[dict] = []

    def interrupt_after_three_rows(row: dict) -> None:
        streamed.append(row)
        if len(streamed) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # on_row runs on the watcher thread; the main thread gets it

    LEDGER["faults_injected"] += 1
    with pytest.raises(KeyboardInterrupt):
        sweep(store_dir, pid_dir=str(pid_dir), delay_s=0.03, on_row=interrupt_after_three_rows)
    assert_ranks_gone(pid_dir)

    before = SweepStore(store_dir).read()
    assert 3 <= before.height < POINTS, before.height
    assert {r["row_id"] for r in streamed} <= set(before["row_id"])
    assert_resumes(store_dir, before)


def test_a_part_file_truncated_mid_sweep_is_named_quarantined_and_remeasured(tmp_path, capsys):
    store_dir = tmp_path / "store"
    store = SweepStore(store_dir)
    truncated: list[Path] = []

    def truncate_the_first_part(row: dict) -> None:
        if not truncated and len(store.parts()) >= 3:  # a full disk, a bad copy, a crashed sync tool
            part = store.parts()[0]
            part.write_bytes(part.read_bytes()[:100])
            truncated.append(part)

    LEDGER["faults_injected"] += 1
    # The sweep never re-reads what it wrote, so it completes; the damage shows on the next read...
    result = sweep(store_dir, on_row=truncate_the_first_part)
    assert len(result.rows) == POINTS and len(truncated) == 1
    (bad,) = truncated
    with pytest.raises(CorruptPartError, match=re.escape(bad.name)):
        store.read()

    # ...and the next run moves the part aside (rank 0 warns, naming it), keeps every other row and re-measures
    # the one point whose row the truncation destroyed.
    readable = store.read(parts=[p for p in store.parts() if p != bad])
    assert readable.height == POINTS - 1
    capsys.readouterr()
    assert_resumes(store_dir, readable)
    assert re.search(rf"\[rank 0\] .*moved corrupt part .*{re.escape(bad.name)}", capsys.readouterr().err)
    assert (store_dir / QUARANTINE_DIR / bad.name).exists()  # kept for inspection, never deleted
    LEDGER["rows_destroyed_by_truncation_and_remeasured"] += 1


# ---------------------------------------------------------------------------------------------------------------
# Concurrent writers: two whole sweeps on one store

_CONCURRENT_SWEEP = """
import json, sys
sys.path.insert(0, sys.argv[3])
from pathlib import Path
from test_reliability import sweep
streamed = []
# Each sweep's ranks say they are ready and wait for the go (instrumented_compile's gate), so the two
# sweeps measure at the same time, not in turn.
result = sweep(Path(sys.argv[1]), variants=[sys.argv[2]], delay_s=0.05, on_row=streamed.append, gate=sys.argv[4],
               call_log=sys.argv[5])
print(json.dumps({"written": len(result.rows), "skipped": result.skipped, "elsewhere": result.elsewhere,
                  "sweep_id": result.sweep_id, "streamed": [r["row_id"] for r in streamed]}))
"""


def _busy_interval(call_log: Path) -> tuple[float, float]:
    """(first call's start, last call's end) over both ranks of one sweep."""
    calls = [tuple(map(float, line.split())) for rank in call_log.parent.glob(f"{call_log.name}-rank*")
             for line in rank.read_text().splitlines()]
    assert calls, f"no model call logged for {call_log.name}"
    return min(c[0] for c in calls), max(c[1] for c in calls)


@pytest.mark.parametrize("variants", [("baseline", "sp"), ("sp", "sp")], ids=["different_points", "same_points"])
def test_two_sweeps_writing_one_store_at_once_lose_nothing(tmp_path, variants):
    """Two notebooks (two caller processes, two ranks each) sweep into the same store at the same time."""
    store_dir, gate = tmp_path / "store", tmp_path / "gate"
    gate.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    tests_dir = str(Path(__file__).parent)
    logs = [tmp_path / f"calls-{i}" for i in range(len(variants))]
    callers = [
        subprocess.Popen(
            [sys.executable, "-c", _CONCURRENT_SWEEP, str(store_dir), variant, tests_dir, str(gate), str(log)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        )
        for variant, log in zip(variants, logs)
    ]
    try:
        deadline = time.monotonic() + 120
        while len(list(gate.glob("ready-*"))) < 2 * len(callers):  # 2 ranks per sweep, one variant each
            assert all(c.poll() is None for c in callers) and time.monotonic() < deadline, "a sweep never got ready"
            time.sleep(0.01)
        (gate / "go").touch()
        outputs = []
        for caller in callers:
            out, err = caller.communicate(timeout=120)
            assert caller.returncode == 0, err[-3000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for caller in callers:
            caller.kill()
            caller.wait()

    # The sweeps really ran at the same time: their model calls overlap for most of the shorter one.
    (a_start, a_end), (b_start, b_end) = map(_busy_interval, logs)
    overlap = min(a_end, b_end) - max(a_start, b_start)
    assert overlap > 0.5 * min(a_end - a_start, b_end - b_start), ((a_start, a_end), (b_start, b_end))

    df = SweepStore(store_dir).read()  # raises CorruptPartError if any part were damaged
    LEDGER["rows_lost"] += sum(o["written"] for o in outputs) - df.height
    assert df.height == sum(o["written"] for o in outputs) and df["row_id"].is_unique().all()
    for o in outputs:
        assert o["written"] + o["skipped"] + o["elsewhere"] == len(TOKENS)
        # Each caller streamed exactly its own rows, although the other sweep's parts land in the same directory.
        mine = set(df.filter(pl.col("sweep_id") == o["sweep_id"])["row_id"])
        assert len(mine) == o["written"] and set(o["streamed"]) == mine
    assert set(df.select("variant", "num_tokens").iter_rows()) == {(v, t) for v in variants for t in TOKENS}
    if variants[0] != variants[1]:
        assert [o["written"] for o in outputs] == [len(TOKENS)] * 2
    else:
        # The same points, measured at the same time: each exactly once (claims), shared between the two.
        assert df.select(KEY_COLUMNS).is_unique().all() and df.height == len(TOKENS)
        assert sum(o["elsewhere"] + o["skipped"] for o in outputs) == len(TOKENS)


# ---------------------------------------------------------------------------------------------------------------
# Progress bars count what a sweep will measure


def _last_bar(err: str) -> str:
    return re.split(r"[\r\n]", err.strip())[-1]


def test_a_resumed_sweeps_bar_ends_at_100_percent(tmp_path, capfd):
    store_dir = tmp_path / "store"
    sweep(store_dir, variants=["baseline"])  # 4 of 12 points on disk
    capfd.readouterr()
    result = sweep(store_dir, progress=True)
    bar = _last_bar(capfd.readouterr().err)
    assert (result.skipped, len(result.rows)) == (4, 8)
    # every point counted, the reused ones from the start and said where from (once 8/12, stopped at 67%)
    assert re.search(r"100%\|.*\| 12/12 \[", bar), bar
    assert re.search(r"4 of 12 points from the sweep of .*, 8 measured now", bar), bar


# ---------------------------------------------------------------------------------------------------------------
# Hostile inputs: nothing sp_lab reads is ever executed


class Canary:
    """Unpickling this touches a file: proof that a loader ran pickle (and so would run an attacker's code)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.fixture
def canary(tmp_path) -> tuple[bytes, Path]:
    """(a pickle that would touch ``marker`` if loaded, ``marker``)."""
    marker = tmp_path / "pickle-was-executed"
    return pickle.dumps({"tp_size": 2, "payload": Canary(marker)}), marker


def _readers(path: Path) -> dict[str, Any]:
    """Every way sp_lab reads a file a user may have been sent."""
    return {
        "LabConfig.from_json": lambda: LabConfig.from_json(path),
        "MatmulRule.from_json": lambda: MatmulRule.from_json(str(path)),
        "CompileReport.load": lambda: CompileReport.load(path),
        "viz.explorer.load_report": lambda: load_report(path),
    }


def test_a_malicious_pickle_is_never_unpickled_by_any_reader(tmp_path, canary):
    payload, marker = canary
    path = tmp_path / "tuned.json"
    path.write_bytes(payload)
    for name, read in _readers(path).items():
        LEDGER["bad_inputs"] += 1
        with pytest.raises((ValueError, TypeError)):  # how clearly: test_a_file_that_is_not_json_...
            read()
        assert not marker.exists(), f"{name} unpickled its input"
    # The sweep store reads parquet only: a pickle named like a part is a corrupt part, nothing more.
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    (store_dir / "part-1-evil.parquet").write_bytes(payload)
    LEDGER["bad_inputs"] += 1
    with pytest.raises(CorruptPartError, match="part-1-evil.parquet"):
        SweepStore(store_dir).read()
    assert not marker.exists()


def test_a_malicious_pickle_checkpoint_is_refused_alone_and_ignored_beside_safetensors(tmp_path, canary):
    pytest.importorskip("transformers")
    from test_checkpoint import _make_hf_model  # a tiny random Llama saved by transformers as safetensors

    payload, marker = canary
    hf = _make_hf_model("llama")
    clean, mixed, pickled = tmp_path / "clean", tmp_path / "mixed", tmp_path / "pickled"
    hf.save_pretrained(clean, safe_serialization=True)
    pickled.mkdir()
    (pickled / "config.json").write_text((clean / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(payload)

    LEDGER["bad_inputs"] += 1
    with pytest.raises(CheckpointError, match=r"pickle checkpoint file\(s\) \['pytorch_model.bin'\].*safetensors"):
        sp_lab.models.build(str(pickled))
    assert not marker.exists()

    # Beside real safetensors the pickle is never read: the weights are the safetensors' ones.
    hf.save_pretrained(mixed, safe_serialization=True)
    (mixed / "pytorch_model.bin").write_bytes(payload)
    LEDGER["bad_inputs"] += 1
    ids = torch.arange(12)
    with torch.no_grad():
        assert torch.equal(sp_lab.models.build(str(mixed))(ids), sp_lab.models.build(str(clean))(ids))
    assert not marker.exists()

    # A pickle renamed to .safetensors fails in the safetensors header parser, never in pickle.
    (pickled / "model.safetensors").write_bytes(payload)
    LEDGER["bad_inputs"] += 1
    with pytest.raises(Exception, match=r"deserializing header"):
        sp_lab.models.build(str(pickled))
    assert not marker.exists()


TINY_HF_CONFIG = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "num_key_value_heads": 2, "vocab_size": 64, "model_type": "llama"}  # fmt: skip


@pytest.mark.parametrize("damage", ["truncated", "not_safetensors"])
def test_a_damaged_safetensors_file_is_named(tmp_path, damage):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    weights = tmp_path / "model.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(64, 32)}, str(weights))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"PK\x03\x04 a zip, not safetensors")
    LEDGER["bad_inputs"] += 1
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(weights))}: not a readable safetensors file \(.+\); "
                                              r"a download cut short"):
        sp_lab.models.build(str(tmp_path))


CODE = "__import__('os').system('touch /tmp/sp_lab_rule_was_executed')"
LEAVES = {"left": {"choice": "fuse"}, "right": {"choice": "no_fuse"}}


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"feature": CODE, "threshold": 1, **LEAVES}, r"root.feature: unknown feature .*__import__.*; allowed: m, n"),
        ({"feature": "m", "threshold": CODE, **LEAVES}, r"root.threshold: expected a number, got str"),
        ({"choice": CODE}, r"root.choice: expected one of 'fuse', 'no_fuse', 'unsure'"),
        ({"feature": "m", "threshold": 1, **LEAVES, CODE: 1}, r"root: unknown keys"),
        ({"feature": "m", "threshold": 1, "left": {"choice": "fuse", "samples": CODE}, "right": {"choice": "fuse"}},
         r"root.left.samples: expected a non-negative int"),
        ({"feature": "m", "threshold": 1, **LEAVES, "__class__": "os.system"}, r"root: unknown keys"),
        ({"feature": "__class__", "threshold": 1, **LEAVES}, r"root.feature: unknown feature '__class__'"),
    ],
    ids=["feature", "threshold", "choice", "key", "samples", "dunder_key", "dunder_feature"],
)  # fmt: skip
def test_heuristic_rules_are_data_code_in_any_field_is_rejected_not_run(tree, message):
    marker = Path("/tmp/sp_lab_rule_was_executed")
    marker.unlink(missing_ok=True)
    LEDGER["bad_inputs"] += 2
    with pytest.raises(RuleError, match=message):
        MatmulRule.from_dict(tree)
    with pytest.raises(ConfigError, match="heuristic: " + message):  # the same rule inside a config file
        LabConfig.from_json(json.dumps({"tp_size": 2, "heuristic": tree}))
    assert not marker.exists()


def test_no_code_executing_loader_anywhere_in_sp_lab():
    """Statically: sp_lab never calls eval / exec / compile(str) / __import__, nor pickle-family loads.

    The one exception is the launcher's cloudpickle on its own channels: the caller writes the job into a
    private temp dir (mkdtemp: mode 0700) for the ranks it started, which read it there (the rank's side of a
    launch, distributed/worker.py), and ranks send results back over pipes.
    """
    launcher, worker = "sp_lab/distributed/launch.py", "sp_lab/distributed/worker.py"
    allowed = {(launcher, "cloudpickle.loads"), (worker, "cloudpickle.load")}
    banned_calls = {"eval", "exec", "compile", "__import__"}
    banned_attrs = {"load", "loads", "Unpickler", "unsafe_load", "full_load"}
    banned_modules = {"pickle", "cloudpickle", "dill", "marshal", "torch", "yaml", "joblib", "shelve", "np", "numpy"}
    found = []
    for path in sorted((REPO / "sp_lab").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id in banned_calls:
                found.append((rel, func.id, node.lineno))
            elif (isinstance(func, ast.Attribute) and func.attr in banned_attrs
                  and isinstance(func.value, ast.Name) and func.value.id in banned_modules
                  and (rel, f"{func.value.id}.{func.attr}") not in allowed):  # fmt: skip
                found.append((rel, f"{func.value.id}.{func.attr}", node.lineno))
    assert not found, f"code-executing loaders in sp_lab: {found}"
    assert "tempfile.mkdtemp(" in (REPO / launcher).read_text()


# ---------------------------------------------------------------------------------------------------------------
# Malformed files: clear errors that name the field or say what the file is not

REPORT = json.loads((REPO / "tests" / "data" / "report_toy_sharded.json").read_text())


def _mutated(edit) -> dict:
    d = json.loads(json.dumps(REPORT))
    edit(d)
    return d


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (_mutated(lambda d: d.pop("ranges")), r"missing field\(s\) \['ranges'\]"),
        (_mutated(lambda d: d.update(schema="sp_lab.compile_report/9")), r"schema 'sp_lab.compile_report/9'"),
        (_mutated(lambda d: d.update(ranges="all")), r"ranges: expected list, got str 'all'"),
        (_mutated(lambda d: d["ranges"][0].update(lo="1")), r"ranges\[0\].lo: expected int, got str '1'"),
        (_mutated(lambda d: d["ranges"][0].update(lo=True)), r"ranges\[0\].lo: expected int, got bool"),
        (_mutated(lambda d: d["ranges"][0].update(lo=9, hi=3)), r"ranges\[0\]: token range \[9, 3\] is empty"),
        (_mutated(lambda d: d["ranges"][1].update(compiled="yes")), r"ranges\[1\].compiled: expected bool"),
        (_mutated(lambda d: d["ranges"][1].update(pieces=None)), r"ranges\[1\].pieces: expected list, got NoneType"),
        (_mutated(lambda d: d["ranges"][1]["pieces"][0].update(op_counts_after=[1, 2])),
         r"ranges\[1\].pieces\[0\].op_counts_after: expected dict\[str, int\], got list"),
        (_mutated(lambda d: d["ranges"][1]["pieces"][0]["op_counts_after"].update(all_reduce="3")),
         r"ranges\[1\].pieces\[0\].op_counts_after\['all_reduce'\]: expected int, got str '3'"),
        (_mutated(lambda d: d["ranges"][1]["pieces"][0].pop("index")), r"pieces\[0\]: missing field\(s\) \['index'\]"),
        (_mutated(lambda d: d["ranges"][1]["pieces"][0].update(shellcode="rm -rf /")),
         r"pieces\[0\]: unknown field 'shellcode'"),
        (_mutated(lambda d: d["ranges"][0].update(failures=[{"piece": 1}])), r"failures\[0\]: missing field"),
        (_mutated(lambda d: d.update(requested=5)), r"requested: expected dict, got int 5"),
        (_mutated(lambda d: d.update(extra=1)), r"unknown field 'extra'"),
        ([REPORT], r"expected a JSON object, got list"),
    ],
    ids=["missing_ranges", "schema", "ranges_str", "lo_str", "lo_bool", "lo_gt_hi", "compiled_str",
         "pieces_none", "op_counts_list", "op_count_str", "piece_missing_index", "piece_unknown_field",
         "failure_incomplete", "requested_int", "unknown_top_level", "not_an_object"],
)  # fmt: skip
def test_malformed_compile_report_names_the_field(doc, message):
    LEDGER["bad_inputs"] += 1
    with pytest.raises(ReportError, match=message):
        CompileReport.from_dict(doc)


NOT_JSON_CASES = [
    pytest.param(reader, content)
    # CompileReport.load is the one strict loader of saved reports; viz.explorer.load_report goes through it.
    for reader in ("LabConfig.from_json", "MatmulRule.from_json", "CompileReport.load", "viz.explorer.load_report")
    for content in ("binary", "truncated", "empty", "array")
]
CONTENTS = {
    "binary": b"\x80\x04\x95\x00 a pickle or a zip, not text \xff",
    "truncated": json.dumps(REPORT).encode()[:300],  # a copy cut short
    "empty": b"",
    "array": b"[1, 2]",
}


@pytest.mark.parametrize(("reader", "content"), NOT_JSON_CASES)
def test_a_file_that_is_not_a_json_object_gets_a_clear_error(tmp_path, reader, content):
    path = tmp_path / "sent-to-me.json"
    path.write_bytes(CONTENTS[content])
    LEDGER["bad_inputs"] += 1
    with pytest.raises((ValueError, TypeError)) as info:
        _readers(path)[reader]()
    error = info.value
    # Clear: sp_lab's own words about JSON or what was expected, not a decoder's internals.
    assert not isinstance(error, (UnicodeDecodeError, json.JSONDecodeError)), repr(error)
    assert re.search(r"JSON|expected", str(error)), str(error)
    if content != "array":
        assert path.name in str(error), str(error)  # which of the files you were sent is broken


def test_the_json_reader_says_what_a_file_is_not(tmp_path):
    """sp_lab.jsonfile.read_json, behind every config and rule loader: one message per way a file is not JSON."""
    cases = {
        "binary": (CONTENTS["binary"], r"not UTF-8 text: byte 0x80 at offset 0; a pickle, a zip"),
        "truncated": (CONTENTS["truncated"], r"not valid JSON \(.* at line 1 column \d+; the text ends early"),
        "empty": (CONTENTS["empty"], r"empty, not valid JSON"),
        "garbled": (b'{"tp_size": 2,, }', r"not valid JSON \(Expecting property name"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_bytes(content)
        LEDGER["bad_inputs"] += 1
        with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: .*{message}"):
            read_json(path, what="config")
    assert read_json(' [1, {"a": 2}]', what="rule") == [1, {"a": 2}]  # text is parsed, never opened
    # Text without its opening brace, longer than a file name may be: the same message, not the OS's.
    with pytest.raises(ValueError, match=r"is neither JSON text \(which starts with '\{' or '\['\)"):
        read_json('  "mode": "sp",' + " x" * 200, what="config")


def test_pickle_or_binary_text_passed_as_config_text_is_not_taken_for_json_or_a_path(canary, tmp_path):
    payload, marker = canary
    for text in (payload.decode("latin-1"), "\x00\x01\x02", "tp_size: 2\nenable_sp: true"):
        LEDGER["bad_inputs"] += 1
        # Control characters or line breaks: no file name looks like that, so it is not looked up as one.
        with pytest.raises(ConfigError, match=r"config: .* is neither JSON text \(which starts with '\{' or '\['\) nor the path"):
            LabConfig.from_json(text)
    LEDGER["bad_inputs"] += 1
    with pytest.raises(ConfigError, match="config: expected a JSON object, got list"):
        LabConfig.from_json("[1, 2]")  # JSON text, just not an object
    LEDGER["bad_inputs"] += 1
    missing = str(tmp_path / "tuned.json")
    with pytest.raises(FileNotFoundError, match=f"no such config file: '{re.escape(missing)}'"):
        LabConfig.from_json(missing)  # a plausible path that does not exist is named as one
    assert not marker.exists()


# -- the sweep store's data files


def _store_with_foreign_part(tmp_path: Path, part: pl.DataFrame) -> tuple[SweepStore, Path]:
    store = SweepStore(tmp_path / "store")
    store.append([make_row(1)])
    foreign = store.path / "part-9999999999999999999-foreign.parquet"  # sorts last: a newer writer's
    part.write_parquet(foreign)
    return store, foreign


FOREIGN_PARTS = {
    "unknown_column": lambda good: good.with_columns(pl.lit("x").alias("injected")),
    "num_tokens_as_string": lambda good: good.with_columns(pl.col("num_tokens").cast(pl.String)),
    "required_columns_missing": lambda good: good.select("row_id", "num_tokens"),
}


@pytest.mark.parametrize("kind", list(FOREIGN_PARTS))
def test_a_store_part_with_a_foreign_schema_is_named(tmp_path, kind):
    good = normalize_rows([make_row(2)])
    store, foreign = _store_with_foreign_part(tmp_path, FOREIGN_PARTS[kind](good))
    LEDGER["bad_inputs"] += 1
    differing = {"unknown_column": r"unknown columns \['injected'\]",
                 "num_tokens_as_string": r"num_tokens is String, expected Int64",
                 "required_columns_missing": r"missing columns \['schema_version', 'sweep_id'"}[kind]
    with pytest.raises(ForeignPartError, match=rf"{re.escape(foreign.name)} .*{differing}"):
        store.read()
    with pytest.warns(UserWarning, match=re.escape(foreign.name)):
        rows = store.read(skip_corrupt=True)  # quarantined; the store's own rows read as before
    assert rows.height == 1 and (store.path / QUARANTINE_DIR / foreign.name).exists()
    assert rows.schema == pl.Schema(ROW_SCHEMA)


@pytest.mark.parametrize(
    ("column", "value", "message"),
    [
        ("latency_us", "fast", r"row 0: column 'latency_us' holds str 'fast'; it takes a number"),
        ("enable_sp", "yes", r"row 0: column 'enable_sp' holds str 'yes'; it takes True or False"),
        ("tp", 2.5, r"row 0: column 'tp' holds float 2.5; it takes an int"),  # never truncated to 2
        ("num_tokens", "8", r"row 0: column 'num_tokens' holds str '8'; it takes an int"),  # never parsed
        ("tp", True, r"row 0: column 'tp' holds bool True; it takes an int"),
    ],
)
def test_a_row_of_the_wrong_type_is_refused_naming_row_column_and_value(column, value, message):
    LEDGER["bad_inputs"] += 1
    with pytest.raises(ValueError, match=message):
        normalize_rows([{**make_row(), column: value}])


# ---------------------------------------------------------------------------------------------------------------
# The README's JupyterLab command: loopback only, token required


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of sockets listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc/net prints them


def _lab_command(**variables: str) -> list[str]:
    dry_run = subprocess.run(
        ["make", "-n", "--no-print-directory", "lab", "STAMP=pyproject.toml", f"PYTHON={sys.executable}",
         *(f"{k}={v}" for k, v in variables.items())],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.replace("\\\n", " ")  # fmt: skip
    (line,) = [line for line in dry_run.splitlines() if "jupyter lab" in line]
    # The recipe first makes its CPU capability's TMPDIR, then starts Jupyter with that capability's cache and
    # TMPDIR (NAME=value words): the command itself is what follows them.
    words = shlex.split(line.split("&&")[-1])
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words.pop(0)
    return words


def test_make_lab_listens_on_loopback_only_and_requires_a_token(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("needs make")
    pytest.importorskip("jupyterlab")
    assert "--IdentityProvider.token=secret" in _lab_command(LAB_TOKEN="secret")
    port = _free_port()
    command = _lab_command(LAB_PORT=str(port))
    assert "--ServerApp.ip=127.0.0.1" in command and "--no-browser" in command
    assert not [arg for arg in command if re.search(r"token=(''|\"\")?$|0\.0\.0\.0|allow_remote|disable_check", arg)]

    # Jupyter refuses to run as root without --allow-root: the Makefile passes it exactly then (it changes
    # nothing about address or token), so `make lab` starts in a root container as elsewhere.
    assert ("--allow-root" in command) == (os.geteuid() == 0), command
    # Started for real, with no user config that could switch the token off.
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")}
    log = tmp_path / "lab.log"
    with open(log, "w") as out:
        lab = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (token := re.search(rf"127\.0\.0\.1:{port}/lab\?token=(\w+)", log.read_text())):
            assert lab.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert _listening_addresses(port) <= LOOPBACK and _listening_addresses(port), _listening_addresses(port)
        url = f"http://127.0.0.1:{port}/api/kernels"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=10)
        assert refused.value.code == 403  # no token, no API
        with urllib.request.urlopen(f"{url}?token={token.group(1)}", timeout=10) as ok:
            assert ok.status == 200
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(lab.pid, signal.SIGTERM)
        try:
            lab.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(lab.pid, signal.SIGKILL)
            lab.wait()
    LEDGER["bad_inputs"] += 1  # one unauthenticated request
