"""The append-only sweep store: schema checks, atomic parts, corrupt parts, concurrent writers, compaction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import polars as pl
import pytest

from sp_lab.bench.store import (
    KEY_COLUMNS,
    QUARANTINE_DIR,
    ROW_SCHEMA,
    SCHEMA_VERSION,
    CorruptPartError,
    NewerSchemaError,
    SweepStore,
    normalize_rows,
)

REPO = Path(__file__).resolve().parents[1]


def make_row(num_tokens: int = 8, **overrides) -> dict:
    """A complete, valid row (values are arbitrary but typed like a real sweep's)."""
    row = {
        "sweep_id": "s0",
        "source": "measured",
        "timestamp": "2025-01-01T00:00:00.000+00:00",
        "model": "toy",
        "hidden_size": 64,
        "num_layers": 2,
        "dtype": "float32",
        "tp": 2,
        "variant": "sp",
        "reported_variant": "sp",
        "boundary": "sharded",
        "num_tokens": num_tokens,
        "enable_sp": True,
        "enable_async_tp": False,
        "async_tp_min_tokens": 1,
        "config_hash": "abc",
        "config_json": "{}",
        "latency_us": 100.0 + num_tokens,
        "p10_us": 90.0,
        "p90_us": 120.0,
        "warmup": 1,
        "repeats": 3,
        "timing_method": "perf_counter",
        "sp_rewrites": 4,
        "n_all_reduce": 1,
        "n_reduce_scatter": 4,
        "n_all_gather": 4,
        "n_fused_ag_mm": 0,
        "n_fused_mm_rs": 0,
        "sp_expected": True,
        "fusion_expected": False,
        "fusion_fired": False,
        "fusion_missing": False,
        "device_name": "cpu: test",
        "device_count": 1,
        "backend": "gloo",
        "torch_version": "2.13.0",
        "sp_lab_version": "0.1.0",
        "hostname": "h",
    }
    row.update(overrides)
    return row


def test_append_then_read_round_trips_with_the_fixed_schema(tmp_path):
    store = SweepStore(tmp_path / "s")
    assert store.read().height == 0 and store.read().schema == pl.Schema(ROW_SCHEMA)
    store.append([make_row(1)])
    store.append([make_row(2), make_row(4)])
    df = store.read()
    assert df.schema == pl.Schema(ROW_SCHEMA)
    assert df["num_tokens"].to_list() == [1, 2, 4]  # oldest part first
    assert df["schema_version"].unique().to_list() == [SCHEMA_VERSION]
    assert df["row_id"].is_unique().all()
    assert len(store.parts()) == 2
    assert store.done_keys(variant="sp") == set(df.select(KEY_COLUMNS).iter_rows())
    assert store.done_keys(variant="baseline") == set()


def test_rows_missing_provenance_or_with_bad_values_are_refused():
    row = make_row()
    del row["device_name"]
    with pytest.raises(ValueError, match=r"row 0 lacks required columns \['device_name'\]"):
        normalize_rows([row])
    with pytest.raises(ValueError, match="row 1 lacks required columns.*'torch_version'"):
        normalize_rows([make_row(), make_row(torch_version=None)])
    with pytest.raises(ValueError, match=r"columns not in ROW_SCHEMA: \['speedup'\]"):
        normalize_rows([make_row(speedup=1.2)])
    with pytest.raises(ValueError, match="source='guessed' is not one of"):
        normalize_rows([make_row(source="guessed")])
    with pytest.raises(ValueError, match="unknown columns"):
        SweepStore("unused").done_keys(colour="red")


def test_a_store_path_that_is_a_file_is_refused_with_a_command_that_parses(tmp_path):
    from sp_lab.cli import build_parser

    f = tmp_path / "rows.parquet"
    f.write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="replay FILE --store DIR") as info:
        SweepStore(f)
    advised = str(info.value).split("`python -m sp_lab ")[1].split("`")[0].split()
    args = build_parser().parse_args(advised)  # the advice is a command the CLI takes as written
    assert (args.command, str(args.source), str(args.store)) == ("replay", "FILE", "DIR")


def test_temporary_files_of_a_writer_in_progress_are_invisible(tmp_path):
    store = SweepStore(tmp_path)
    store.append([make_row()])
    (tmp_path / ".part-123.parquet.tmp").write_bytes(b"half a part")
    assert store.read().height == 1


def test_truncated_part_gets_a_clear_error_and_skip_corrupt_quarantines_it(tmp_path):
    store = SweepStore(tmp_path)
    store.append([make_row(1)])
    bad = store.append([make_row(2)])
    store.append([make_row(4)])
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # e.g. a copy cut short or a full disk

    with pytest.raises(CorruptPartError, match=rf"corrupt part file in sweep store: .*{bad.name}") as info:
        store.read()
    assert info.value.path == bad and "skip_corrupt=True" in str(info.value)

    with pytest.warns(UserWarning, match=f"moved corrupt part .*{bad.name}"):
        df = store.read(skip_corrupt=True)
    assert df["num_tokens"].to_list() == [1, 4]
    assert (tmp_path / QUARANTINE_DIR / bad.name).exists() and not bad.exists()
    # the next run resumes: the store reads cleanly and the lost row's key is simply not done
    assert store.read().height == 2
    assert {k[KEY_COLUMNS.index("num_tokens")] for k in store.done_keys()} == {1, 4}


def test_done_keys_quarantines_by_default_so_a_resume_can_start(tmp_path):
    store = SweepStore(tmp_path)
    store.append([make_row(1)])
    bad = store.append([make_row(2)])
    bad.write_bytes(b"PAR1 not really")
    with pytest.warns(UserWarning, match="moved corrupt part"):
        assert len(store.done_keys()) == 1


_WRITER = textwrap.dedent(
    """
    import json, os, sys, time
    sys.path.insert(0, sys.argv[3])
    from sp_lab.bench.store import SweepStore
    from test_store import make_row
    store, me, sync = SweepStore(sys.argv[1]), sys.argv[2], sys.argv[4]
    other = "b" if me == "a" else "a"
    spans = []
    for i in range(ROWS):
        # a barrier before every append: both writers append row i at the same moment
        open(os.path.join(sync, f"{me}{i}"), "w").close()
        while not os.path.exists(os.path.join(sync, f"{other}{i}")):
            time.sleep(0.0002)
        start = time.time()
        store.append([make_row(i + 1, sweep_id=me)])
        spans.append((start, time.time()))
    print(json.dumps(spans))
    """
)
CONCURRENT_ROWS = 50


def test_two_concurrent_writers_lose_nothing(tmp_path):
    """Two processes appending 50 rows each, at the same time, to one store -> exactly 100 rows.

    The writers meet at a barrier before every append, and the test checks that their appends really overlapped
    in time: a run where one writer finished before the other started would prove nothing."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    tests_dir = str(Path(__file__).parent)
    store_dir, sync = tmp_path / "store", tmp_path / "sync"
    sync.mkdir()
    script = _WRITER.replace("ROWS", str(CONCURRENT_ROWS))
    writers = [
        subprocess.Popen([sys.executable, "-c", script, str(store_dir), name, tests_dir, str(sync)], env=env,
                         stdout=subprocess.PIPE, text=True)
        for name in ("a", "b")
    ]
    deadline = time.monotonic() + 120
    while any(w.poll() is None for w in writers) and time.monotonic() < deadline:
        if any(w.poll() not in (None, 0) for w in writers):
            break  # one writer failed: the other would wait at the barrier for ever
        time.sleep(0.05)
    for w in writers:
        if w.poll() is None:
            w.kill()
    outs = [w.communicate(timeout=30)[0] for w in writers]
    assert [w.returncode for w in writers] == [0, 0], "a writer failed (its traceback is above)"
    spans_a, spans_b = (json.loads(out) for out in outs)
    overlapping = sum(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(spans_a, spans_b, strict=True))
    assert overlapping >= CONCURRENT_ROWS // 5, f"only {overlapping} of {CONCURRENT_ROWS} appends overlapped"
    df = SweepStore(store_dir).read()
    assert df.height == 2 * CONCURRENT_ROWS
    assert df.group_by("sweep_id").len().sort("sweep_id")["len"].to_list() == [CONCURRENT_ROWS] * 2
    assert df["row_id"].is_unique().all()


@pytest.mark.parametrize("extra_column", [True, False], ids=["new-column", "same-columns"])
def test_a_part_of_a_newer_schema_is_refused_and_never_quarantined(tmp_path, extra_column):
    store = SweepStore(tmp_path)
    store.append([make_row(1)])
    newer = store.append([make_row(2)])
    frame = pl.read_parquet(newer).with_columns(schema_version=pl.lit(SCHEMA_VERSION + 1, pl.Int32))
    if extra_column:
        frame = frame.with_columns(added_later=pl.lit(1.5))
    frame.write_parquet(newer)
    store.append([make_row(3)])
    wanted = f"written by a newer sp_lab \\(schema v{SCHEMA_VERSION + 1}; this one reads up to v{SCHEMA_VERSION}\\)"
    for read in (store.read, lambda: store.read(skip_corrupt=True), store.done_keys,
                 lambda: store.read_new(set()), store.compact):
        with pytest.raises(NewerSchemaError, match=wanted + ": upgrade sp_lab") as err:
            read()
        assert err.value.path == newer
    assert newer.exists() and not (tmp_path / QUARANTINE_DIR).exists()
    assert len(store.parts()) == 3  # compact refused too, and removed nothing


def test_compact_merges_parts_and_keeps_every_row_once(tmp_path):
    store = SweepStore(tmp_path)
    for t in range(1, 6):
        store.append([make_row(t)])
    before = store.read()
    merged = store.compact()
    assert store.parts() == [merged]
    after = store.read()
    assert after.sort("num_tokens").equals(before.sort("num_tokens"))
    assert store.compact() is None  # one part: nothing to do


def test_readers_drop_duplicates_left_by_an_interrupted_compaction(tmp_path):
    store = SweepStore(tmp_path)
    store.append([make_row(1)])
    store.append([make_row(2)])
    # a compaction that wrote its merged part and died before deleting the old parts
    store.append(store.read())
    assert len(store.parts()) == 3
    assert store.read()["num_tokens"].sort().to_list() == [1, 2]


def _compact_after_first_listing(monkeypatch, store: SweepStore) -> None:
    """Make the next ``store.parts()`` return its listing and then compact the store, as a compaction running
    beside a reader does between the reader's listing and its reading: the listed parts are gone, their rows
    are in a merged part that listing did not see."""
    listing = SweepStore.parts
    fired = []

    def parts_then_compact(self):
        listed = listing(self)
        if not fired:
            fired.append(True)
            assert self.compact() is not None
        return listed

    monkeypatch.setattr(SweepStore, "parts", parts_then_compact)


def test_read_new_beside_a_compaction_lists_again_and_returns_every_row_once(tmp_path, monkeypatch):
    store = SweepStore(tmp_path)
    for t in (1, 2, 3):
        store.append([make_row(t)])
    seen: set[Path] = set()
    _compact_after_first_listing(monkeypatch, store)
    new = store.read_new(seen)
    assert sorted(new["num_tokens"].to_list()) == [1, 2, 3]  # none lost, none twice
    assert seen == set(store.parts()) and len(seen) == 1  # the merged part, whose rows were returned
    assert store.read_new(seen).height == 0
    store.append([make_row(4)])
    assert store.read_new(seen)["num_tokens"].to_list() == [4]


def test_claim_points_beside_a_compaction_sees_the_points_already_done(tmp_path, monkeypatch):
    store = SweepStore(tmp_path)
    store.append([make_row(8)])
    store.append([make_row(16)])
    keys = {"a": tuple(make_row(8)[c] for c in KEY_COLUMNS), "b": tuple(make_row(16)[c] for c in KEY_COLUMNS)}
    seen: set[Path] = set()
    done: set[tuple] = set()
    # the claims list nothing; the first listing is read_new's
    _compact_after_first_listing(monkeypatch, store)
    claims = store.claim_points(keys, seen, done)
    assert claims == {} and done == set(keys.values())


def test_read_part_by_part_beside_a_compaction_lists_again(tmp_path, monkeypatch):
    store = SweepStore(tmp_path)
    for t in (1, 2):
        store.append([make_row(t)])
    # a foreign part sends the read down the part-by-part path, where the vanished parts are met
    pl.DataFrame({"x": [1]}).write_parquet(tmp_path / "part-0-foreign.parquet")
    read_each = SweepStore._read_each
    fired = []

    def compact_then_read_each(self, paths, **kwargs):
        if not fired:  # the fast read failed on the foreign part; now a compaction removes the listed rows' parts
            fired.append(True)
            rows = [q for q in paths if "foreign" not in q.name]
            self.append(self.read(parts=rows))
            for q in rows:
                q.unlink()
        return read_each(self, paths, **kwargs)

    monkeypatch.setattr(SweepStore, "_read_each", compact_then_read_each)
    with pytest.warns(UserWarning, match="moved corrupt part"):
        rows = store.read(skip_corrupt=True)
    assert sorted(rows["num_tokens"].to_list()) == [1, 2]


def test_read_of_given_parts_that_vanished_raises(tmp_path):
    store = SweepStore(tmp_path)
    store.append([make_row(1)])
    part = store.append([make_row(2)])
    part.unlink()
    with pytest.raises(FileNotFoundError):
        store.read(parts=store.parts() + [part])


# ---------------------------------------------------------------------------------------------------------------
# Claims: one measurement per point across concurrent sweeps, crash-safe

KEY = ("toy", 64, 2, 2, "float32", "sp", "sharded", 8, "cpu", "gloo", "abc")


def test_a_claimed_point_is_refused_to_others_until_released(tmp_path):
    store = SweepStore(tmp_path / "store")
    first = store.claim(KEY)
    assert first is not None and first.path.parent.name == ".claims"
    assert store.claim(KEY) is None  # another open of the claim file: the flock is held
    other = store.claim((*KEY[:-1], "def"))  # another point is free
    assert other is not None
    first.release()
    again = store.claim(KEY)
    assert again is not None
    again.release(), other.release()
    first.release()  # releasing twice is harmless
    assert store.parts() == [] and store.read().height == 0  # claims are not rows


def test_the_claim_of_a_killed_process_is_taken_over(tmp_path):
    store_dir = tmp_path / "store"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from sp_lab.bench.store import SweepStore
            claim = SweepStore({str(store_dir)!r}).claim({KEY!r})
            print("held" if claim else "refused", flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        store = SweepStore(store_dir)
        assert store.claim(KEY) is None  # a live holder keeps it
        assert f'"pid": {holder.pid}' in next((store_dir / ".claims").glob("*.claim")).read_text()
        holder.kill()  # SIGKILL: no clean-up of any kind ran
        holder.wait(timeout=10)
        taken = store.claim(KEY)
        assert taken is not None, "a dead process's claim must not block the point forever"
        assert f'"pid": {os.getpid()}' in taken.path.read_text()
        taken.release()
    finally:
        holder.kill()
        holder.wait(timeout=10)
        holder.stdout.close()


def test_a_point_measured_between_listing_and_claiming_is_not_measured_again(tmp_path):
    """The race the re-check after a claim closes: sweep A lists the store (the point has no row), sweep B claims
    the point, appends its row and lets the claim go, and only then A claims. A must see B's row and give up."""
    store = SweepStore(tmp_path / "store")
    key = tuple(make_row(8)[c] for c in KEY_COLUMNS)
    seen, done = set(store.parts()), store.done_keys(source="measured")  # A's listing: nothing measured yet
    assert key not in done
    listed, measured, b_got = threading.Event(), threading.Event(), []

    def sweep_b() -> None:  # another sweep of the same store (its own open file, so its own flock)
        listed.wait(30)
        other = SweepStore(tmp_path / "store")
        claim = other.claim(key)
        b_got.append(claim is not None)
        other.append([make_row(8, sweep_id="b")])
        claim.release()  # after the row is on disk, as a sweep does
        measured.set()

    b = threading.Thread(target=sweep_b)
    b.start()
    listed.set()
    assert measured.wait(30) and b_got == [True]
    b.join(timeout=30)
    claims = store.claim_points({"sp": key}, seen, done)
    assert claims == {}, "A claimed a point B measured after A listed the store: it would be measured twice"
    assert key in done
    again = store.claim(key)  # A let its claim go: nothing holds the point
    assert again is not None
    again.release()
    assert store.read().height == 1


def test_a_claim_counts_a_point_done_by_a_row_of_the_claiming_sweeps_own_source(tmp_path):
    """Rehearsal sweeps (ranks sharing one GPU) plan by rehearsal rows: a point another rehearsal sweep measured
    after the listing is done for them, and a measured row does not make a rehearsal point done (nor the reverse)."""
    store = SweepStore(tmp_path / "store")
    key = tuple(make_row(8)[c] for c in KEY_COLUMNS)
    seen = set(store.parts())
    store.append([make_row(8, source="rehearsal", sweep_id="b")])  # the concurrent rehearsal sweep's row
    done: set = set()
    assert store.claim_points({"sp": key}, set(seen), done, source="rehearsal") == {}
    assert key in done
    measured_done: set = set()
    claims = store.claim_points({"sp": key}, set(seen), measured_done)  # default: a measuring sweep's
    assert list(claims) == ["sp"] and key not in measured_done
    claims["sp"].release()


def test_a_plan_is_recorded_read_and_forgotten(tmp_path):
    store = SweepStore(tmp_path / "store")
    assert store.planned_points("s1") is None
    store.record_plan("s1", 12)
    store.record_plan("s1", 9)  # a concurrent sweep took 3 points
    assert store.planned_points("s1") == 9 and store.parts() == []
    store.forget_plan("s1")
    assert store.planned_points("s1") is None
