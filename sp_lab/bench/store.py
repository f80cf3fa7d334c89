"""An append-only dataset of measured rows: a directory of small parquet part files.

Why a directory of parts rather than one parquet file: a parquet file cannot be appended to in
place (its footer holds the row-group index), so "append one row to data.parquet" means rewriting
the file, and a crash or a second writer in the middle of that rewrite loses everything. Here every
append writes one new, uniquely named part file to a temporary name and ``os.replace``-s it into
place, which is atomic on POSIX file systems. Hence:

- an interrupted sweep loses at most the row being written (never a row already on disk);
- any number of processes may append to the same store at once without locks (names never collide);
- a reader sees a consistent snapshot: every part is either absent or complete.

Rows follow :data:`ROW_SCHEMA` (a fixed polars schema with a ``schema_version`` column). Each row
carries a ``row_id`` (uuid4) so that :meth:`SweepStore.compact` can run beside readers: a reader that
catches the moment between "compacted file written" and "old parts deleted" sees duplicates and
drops them by ``row_id``.

Layout::

    store_dir/
      part-<unix_ns>-<host>-<pid>-<uuid>.parquet   one per append (usually one row)
      .part-....parquet.tmp                          being written (ignored by readers)
      quarantine/                                    corrupt parts moved aside by read(skip_corrupt=True)
      .claims/<point id>.claim                       a lock per point while a sweep measures it
      .plans/<sweep_id>.json                         how many points a running sweep will measure

Two sweeps of the same points measure each point once: before measuring a point a sweep takes its
claim (:meth:`SweepStore.claim`), an exclusive ``flock`` on the point's claim file, and checks again
that no row landed meanwhile; the holder appends the row *before* letting the claim go. The kernel drops
the lock of a process that dies, so a crashed sweep's claim is taken over by the next sweep, never stuck.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import numbers
import os
import socket
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import polars as pl

from sp_lab.vocabulary import MEASURED, SOURCES

SCHEMA_VERSION = 2
"""Bumped whenever :data:`ROW_SCHEMA` changes; every row records the version it was written with.
Version 2 added ``ci_low_us`` / ``ci_high_us``; version-1 parts read with those columns null."""

ROW_SCHEMA: dict[str, pl.DataType] = {
    # --- bookkeeping
    "schema_version": pl.Int32(),
    "row_id": pl.String(),  # uuid4 hex, unique per row; de-duplicates across compaction
    "sweep_id": pl.String(),  # uuid of the sweep invocation that produced the row
    "source": pl.String(),  # one of SOURCES
    "timestamp": pl.String(),  # UTC ISO-8601, when the row was measured
    # --- what was measured
    "model": pl.String(),
    "hidden_size": pl.Int64(),
    "num_layers": pl.Int64(),
    "dtype": pl.String(),
    "tp": pl.Int64(),
    "variant": pl.String(),  # baseline | sp | sp+async_tp | tuned
    "reported_variant": pl.String(),  # the variant, or "<variant> [fusion missing]" when it did not run
    "boundary": pl.String(),
    "num_tokens": pl.Int64(),
    "enable_sp": pl.Boolean(),  # requested by the variant's config
    "enable_async_tp": pl.Boolean(),
    "async_tp_min_tokens": pl.Int64(),
    "config_hash": pl.String(),
    "config_json": pl.String(),  # the full LabConfig of the variant, to reproduce the row
    # --- the numbers
    # the median over calls of the slowest rank's time for each call (a TP step is as slow as its slowest rank;
    # sp_lab.bench.interleave)
    "latency_us": pl.Float64(),
    "p10_us": pl.Float64(),
    "p90_us": pl.Float64(),
    # 95% confidence interval of latency_us (the median), from the interleaved repetitions; null in rows
    # written before schema version 2 and in rows without a spread (simulated)
    "ci_low_us": pl.Float64(),
    "ci_high_us": pl.Float64(),
    "warmup": pl.Int64(),
    "repeats": pl.Int64(),
    "timing_method": pl.String(),  # perf_counter | cuda_events | cuda_graph
    # --- what actually ran (from the CompileReport, for this token count)
    "sp_rewrites": pl.Int64(),
    "n_all_reduce": pl.Int64(),
    "n_reduce_scatter": pl.Int64(),
    "n_all_gather": pl.Int64(),
    "n_fused_ag_mm": pl.Int64(),
    "n_fused_mm_rs": pl.Int64(),
    "sp_expected": pl.Boolean(),
    "fusion_expected": pl.Boolean(),
    "fusion_fired": pl.Boolean(),
    "fusion_missing": pl.Boolean(),  # the variant's transformation was expected and did not run
    # --- where
    "device_name": pl.String(),
    "device_count": pl.Int64(),
    "backend": pl.String(),
    "torch_version": pl.String(),
    "sp_lab_version": pl.String(),
    "hostname": pl.String(),
    "note": pl.String(),  # free text: timing fallbacks, why fusion was not expected, ...
}
"""The fixed schema of a row. Every column but :data:`NULLABLE_COLUMNS` must be non-null."""

NULLABLE_COLUMNS = frozenset({"note", "ci_low_us", "ci_high_us"})

KEY_COLUMNS = (
    "model",
    "hidden_size",
    "num_layers",
    "tp",
    "dtype",
    "variant",
    "boundary",
    "num_tokens",
    "device_name",
    "backend",
    "torch_version",
    "config_hash",
)
"""A row's identity for resume: a sweep skips a (key) that already has a measured row. Every setup column
(:data:`sp_lab.vocabulary.SETUP_COLUMNS`) is in it: a point counted as done is a point of the same setup."""

QUARANTINE_DIR = "quarantine"
CLAIMS_DIR = ".claims"
PLANS_DIR = ".plans"


class CorruptPartError(RuntimeError):
    """A part file of the store cannot be read (truncated, or not parquet)."""

    def __init__(self, path: Path, cause: BaseException):
        self.path = path
        super().__init__(
            f"corrupt part file in sweep store: {path} ({type(cause).__name__}: {cause}). "
            "It was probably truncated by a crash, a full disk or a partial copy. Read with "
            "read(skip_corrupt=True) (CLI: --skip-corrupt) to move it to "
            f"{path.parent / QUARANTINE_DIR}/ and go on; a resumed sweep re-measures its row."
        )



class ForeignPartError(ValueError):
    """A part file of the store reads as parquet but does not hold rows of :data:`ROW_SCHEMA`."""

    def __init__(self, path: Path, problems: Sequence[str]):
        self.path, self.problems = path, list(problems)
        super().__init__(
            f"sweep store part {path} does not hold sweep rows of schema version {SCHEMA_VERSION}: "
            f"{'; '.join(problems)}. It was written by something else (or by hand); move it out of "
            f"{path.parent}, or read with skip_corrupt=True (CLI: --skip-corrupt) to move it to "
            f"{path.parent / QUARANTINE_DIR}/."
        )


class NewerSchemaError(RuntimeError):
    """A part of the store was written by a newer sp_lab (``schema_version`` above :data:`SCHEMA_VERSION`).

    Never quarantined, whatever ``skip_corrupt`` says: the part is sound, this sp_lab is too old to read it, and
    moving it aside would make its rows vanish for every reader, the newer ones included.
    """

    def __init__(self, path: Path, version: int):
        self.path, self.version = path, version
        super().__init__(
            f"sweep store part {path} was written by a newer sp_lab (schema v{version}; this one reads up to "
            f"v{SCHEMA_VERSION}): upgrade sp_lab. The part was left in place."
        )


def newer_schema_version(frame: pl.DataFrame) -> int | None:
    """The largest ``schema_version`` of ``frame`` when it is above :data:`SCHEMA_VERSION`, else ``None``."""
    if "schema_version" not in frame.columns or not frame.schema["schema_version"].is_integer():
        return None
    newest = frame["schema_version"].max()
    return int(newest) if newest is not None and newest > SCHEMA_VERSION else None


def schema_problems(schema: Mapping[str, pl.DataType]) -> list[str]:
    """How a part's schema differs from :data:`ROW_SCHEMA`, one phrase per column group (empty: it fits).

    Parts of an older schema version may lack the nullable columns added since; nothing else may differ.
    """
    problems = []
    unknown = [c for c in schema if c not in ROW_SCHEMA]
    if unknown:
        problems.append(f"unknown columns {unknown}")
    missing = [c for c in ROW_SCHEMA if c not in schema and c not in NULLABLE_COLUMNS]
    if missing:
        problems.append(f"missing columns {missing}")
    for column, dtype in schema.items():
        if column in ROW_SCHEMA and dtype != ROW_SCHEMA[column]:
            problems.append(f"{column} is {dtype}, expected {ROW_SCHEMA[column]}")
    return problems


# What a row's value may be, per column dtype. numpy scalars pass (a timer may hand them over); bool is an
# int in Python, so it is refused where a number is expected, and floats are never truncated to ints.
_ACCEPTS: dict[type, tuple[str, Callable[[object], bool]]] = {
    pl.Int32: ("an int", lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)),
    pl.Int64: ("an int", lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)),
    pl.Float64: ("a number", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)),
    pl.Boolean: ("True or False", lambda v: isinstance(v, bool) or (type(v).__module__ == "numpy"
                                                                    and type(v).__name__ in ("bool", "bool_"))),
    pl.String: ("a str", lambda v: isinstance(v, str)),
}


def _check_value(i: int, column: str, value: object) -> None:
    dtype = ROW_SCHEMA[column]
    wanted, accepts = _ACCEPTS[type(dtype)]
    if value is not None and not accepts(value):
        raise ValueError(f"row {i}: column {column!r} holds {type(value).__name__} {value!r}; it takes {wanted} ({dtype})")


def point_id(key: Sequence[object]) -> str:
    """A file-name-safe id of a point (a :data:`KEY_COLUMNS` tuple): sha1 of its JSON, 20 hex digits."""
    return hashlib.sha1(json.dumps([str(k) for k in key]).encode()).hexdigest()[:20]


@dataclasses.dataclass
class PointClaim:
    """A held claim on one point (see :meth:`SweepStore.claim`)."""

    path: Path
    """The claim file, ``<store>/.claims/<point id>.claim``."""
    fd: int | None
    """The open, locked descriptor; ``None`` once released."""

    def release(self) -> None:
        """Let the point go (after its row is on disk, so whoever claims it next sees the row)."""
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None


def release_claims(claims: Mapping[str, PointClaim]) -> None:
    """Release every claim of :meth:`SweepStore.claim_points` (releasing twice is harmless)."""
    for claim in claims.values():
        claim.release()


def data_hash(rows: pl.DataFrame) -> str:
    """16 hex digits naming a set of rows: their sorted ``row_id``s, or their content where rows have none. The one
    name of "these rows" that exported files, serving answers and the tuner compare."""
    if "row_id" in rows.columns and rows["row_id"].null_count() == 0:
        text = "\n".join(sorted(rows["row_id"].to_list()))
    else:
        text = "\n".join(sorted(map(str, rows.select(sorted(rows.columns)).iter_rows())))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def new_row_id() -> str:
    """A fresh ``row_id`` (uuid4 hex)."""
    return uuid.uuid4().hex


def normalize_rows(rows: Sequence[Mapping[str, object]]) -> pl.DataFrame:
    """Check ``rows`` against :data:`ROW_SCHEMA` and return them as a DataFrame of exactly that schema.

    Fills ``schema_version`` and ``row_id`` when absent. Raises ``ValueError`` naming the row and
    column for an unknown column, a missing or null required column, a value of the wrong type (``tp=2.5``,
    ``num_tokens="8"``; never cast), or a bad ``source``.
    """
    filled = []
    for i, row in enumerate(rows):
        unknown = sorted(set(row) - set(ROW_SCHEMA))
        if unknown:
            raise ValueError(f"row {i} has columns not in ROW_SCHEMA: {unknown}; known: {sorted(ROW_SCHEMA)}")
        full = {"schema_version": SCHEMA_VERSION, "row_id": new_row_id(), **dict.fromkeys(NULLABLE_COLUMNS),
                **row}
        missing = [c for c in ROW_SCHEMA if c not in NULLABLE_COLUMNS and full.get(c) is None]
        if missing:
            raise ValueError(
                f"row {i} lacks required columns {missing} (every column of ROW_SCHEMA except "
                f"{sorted(NULLABLE_COLUMNS)} must be set; provenance is never optional)"
            )
        # polars would cast silently (tp=2.5 -> 2, "8" -> 8) or fail naming neither row nor column.
        for column, value in full.items():
            _check_value(i, column, value)
        if full["source"] not in SOURCES:
            raise ValueError(f"row {i}: source={full['source']!r} is not one of {SOURCES}")
        filled.append(full)
    return pl.DataFrame(filled, schema=ROW_SCHEMA)


@dataclasses.dataclass
class SweepStore:
    """An append-only, crash-safe, multi-writer dataset of sweep rows under ``path`` (see module doc).

    Usage (``row`` a dict of :data:`ROW_SCHEMA` columns)::

        store = SweepStore("out/sweeps")
        store.append([row])                                 # one atomic part file
        df = store.read()                                   # every row, ROW_SCHEMA columns
        store.done_keys(source="measured", model="toy")     # resume keys
    """

    path: Path
    """The store directory (created on first append)."""

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(
                f"sweep store {self.path} is a file; a store is a directory of part files. "
                "To import a single parquet file use `python -m sp_lab replay FILE --store DIR`."
            )

    # ------------------------------------------------------------------ writing
    def append(self, rows: Sequence[Mapping[str, object]] | pl.DataFrame) -> Path | None:
        """Append ``rows`` as one new part file, atomically; returns its path (None for no rows).

        The part is written to a hidden temporary name, flushed to disk, then renamed into place:
        a reader or a crash never sees half a part.
        """
        df = rows if isinstance(rows, pl.DataFrame) else normalize_rows(rows)
        if df.height == 0:
            return None
        if df.schema != pl.Schema(ROW_SCHEMA):
            df = normalize_rows(df.to_dicts())
        self.path.mkdir(parents=True, exist_ok=True)
        # time first so that a plain sort of the names is (roughly) the order of measurement
        name = f"part-{time.time_ns()}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.parquet"
        final = self.path / name
        tmp = self.path / f".{name}.tmp"
        buf = io.BytesIO()
        df.write_parquet(buf)
        with open(tmp, "wb") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        return final

    # ------------------------------------------------------------------ reading
    def parts(self) -> list[Path]:
        """The complete part files, oldest first (temporary and quarantined files excluded)."""
        if not self.path.is_dir():
            return []
        return sorted(p for p in self.path.glob("*.parquet") if p.is_file())

    def read(self, *, skip_corrupt: bool = False, parts: Sequence[Path] | None = None) -> pl.DataFrame:
        """Every row of the store as one DataFrame with :data:`ROW_SCHEMA` columns, oldest first.

        A part that cannot be read raises :class:`CorruptPartError` naming it, a part whose columns are
        not :data:`ROW_SCHEMA`'s :class:`ForeignPartError` naming it and the differing columns; with
        ``skip_corrupt=True`` either part is moved to ``quarantine/`` with a warning and reading goes on. A part
        written by a newer sp_lab (``schema_version`` above :data:`SCHEMA_VERSION`) raises
        :class:`NewerSchemaError` and is never quarantined.
        ``parts`` restricts the read to those files (see :meth:`read_new`).
        """
        for _attempt in range(3):
            paths = self.parts() if parts is None else list(parts)
            if not paths:
                return pl.DataFrame(schema=ROW_SCHEMA)
            vanished: FileNotFoundError | None = None
            try:
                df = pl.scan_parquet(paths).collect()
                if schema_problems(df.schema) or newer_schema_version(df) is not None:
                    # some part differs (the fast path took the first part's schema): find and name it
                    raise pl.exceptions.SchemaError("a part's schema differs from ROW_SCHEMA")
            except FileNotFoundError as e:
                vanished = e
            except (pl.exceptions.PolarsError, OSError):
                # the fast path failed: read part by part to name (and maybe quarantine) the culprit
                try:
                    df = self._read_each(paths, skip_corrupt=skip_corrupt)
                except FileNotFoundError as e:
                    vanished = e
            if vanished is not None:
                # A compaction removed a part between listing and reading. Its rows are in the merged part,
                # which may be newer than the listing, so skipping the part could lose them: list again
                # (read_new does so for a given ``parts``).
                if parts is not None:
                    raise vanished
                continue
            return self._dedupe(df)
        raise RuntimeError(f"sweep store {self.path} kept changing while being read (concurrent compaction?)")

    def _read_each(self, paths: Sequence[Path], *, skip_corrupt: bool) -> pl.DataFrame:
        frames = []
        for p in paths:
            try:
                frame = pl.read_parquet(p)
            except FileNotFoundError:
                raise  # compacted away meanwhile: the caller lists again (see read)
            except (pl.exceptions.PolarsError, OSError) as e:
                err = CorruptPartError(p, e)
                if not skip_corrupt:
                    raise err from e
                self.quarantine(p, reason=str(err))
                continue
            version = newer_schema_version(frame)
            if version is not None:
                raise NewerSchemaError(p, version)  # whatever skip_corrupt says: the part is sound
            problems = schema_problems(frame.schema)
            if problems:
                if not skip_corrupt:
                    raise ForeignPartError(p, problems)
                self.quarantine(p, reason=str(ForeignPartError(p, problems)))
                continue
            frames.append(frame)
        if not frames:
            return pl.DataFrame(schema=ROW_SCHEMA)
        # diagonal_relaxed tolerates parts from another schema_version (missing columns -> null)
        return pl.concat(frames, how="diagonal_relaxed")

    @staticmethod
    def _dedupe(df: pl.DataFrame) -> pl.DataFrame:
        # parts of an older schema version lack the columns added since: null, never absent
        absent = [c for c in ROW_SCHEMA if c not in df.columns and c in NULLABLE_COLUMNS]
        df = df.with_columns(pl.lit(None, dtype=ROW_SCHEMA[c]).alias(c) for c in absent)
        df = df.select([c for c in ROW_SCHEMA if c in df.columns], *[c for c in df.columns if c not in ROW_SCHEMA])
        return df.unique(subset="row_id", keep="first", maintain_order=True)

    def read_new(self, seen: set[Path], *, skip_corrupt: bool = True) -> pl.DataFrame:
        """Rows of parts not in ``seen`` (which is updated): for watching a sweep from another process.

        A part that a concurrent :meth:`compact` removed between listing and reading is not skipped (its rows
        are in a merged part, perhaps not listed yet): the parts not in ``seen`` are listed again and read
        again. ``seen`` gains only parts whose rows were returned.
        """
        for _attempt in range(3):
            new = [p for p in self.parts() if p not in seen]
            if not new:
                return pl.DataFrame(schema=ROW_SCHEMA)
            try:
                df = self.read(parts=new, skip_corrupt=skip_corrupt)
            except FileNotFoundError:
                continue  # compacted away meanwhile: list again
            seen.update(new)
            return df
        raise RuntimeError(f"sweep store {self.path} kept changing while being read (concurrent compaction?)")

    def quarantine(self, part: Path, *, reason: str = "") -> Path:
        """Move a (corrupt) part to ``quarantine/`` so that reads and resumes go on without it."""
        qdir = self.path / QUARANTINE_DIR
        qdir.mkdir(exist_ok=True)
        dest = qdir / part.name
        os.replace(part, dest)
        warnings.warn(f"moved corrupt part {part} to {dest}: {reason}", stacklevel=3)
        return dest

    # ------------------------------------------------------------------ queries
    def done_keys(self, *, skip_corrupt: bool = True, **filters: object) -> set[tuple]:
        """The :data:`KEY_COLUMNS` tuples of rows matching ``filters`` (column=value, e.g. ``source="measured"``).

        Defaults to ``skip_corrupt=True``: a resumed sweep should re-measure a corrupt part's row
        rather than refuse to start.
        """
        unknown = sorted(set(filters) - set(ROW_SCHEMA))
        if unknown:
            raise ValueError(f"done_keys filters on unknown columns {unknown}; known: {sorted(ROW_SCHEMA)}")
        df = self.read(skip_corrupt=skip_corrupt)
        for col, value in filters.items():
            df = df.filter(pl.col(col) == value)
        return set(df.select(KEY_COLUMNS).iter_rows())

    def __len__(self) -> int:
        return self.read().height

    # ------------------------------------------------------------------ coordination of concurrent sweeps
    def claim(self, key: Sequence[object]) -> PointClaim | None:
        """Claim the point ``key`` (a :data:`KEY_COLUMNS` tuple) for measuring, or ``None`` when a live
        process holds it. Release with :meth:`PointClaim.release` after the row is appended.

        The claim is an exclusive, non-blocking ``flock`` on ``.claims/<point id>.claim``: the kernel
        releases it when its process ends, however it ends, so a dead sweep's claim is simply taken over.
        Claim files are never deleted (deleting one while another process opens it would let two
        processes lock two different files of one name).
        """
        import fcntl  # POSIX; sweeps run on Linux ranks

        directory = self.path / CLAIMS_DIR
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{point_id(key)}.claim"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        # Who holds it, for a person looking at a stuck sweep; the lock itself is what counts.
        holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                             "key": [str(k) for k in key]})
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        return PointClaim(path=path, fd=fd)

    def claim_points(self, keys: Mapping[str, tuple], seen: set[Path], done: set[tuple], *,
                     source: str = MEASURED) -> dict[str, PointClaim]:
        """Claims on those of ``keys`` (name -> point key) that no row of ``source`` and no live sweep covers.

        ``source``: what the claiming sweep writes (``measured``, or ``rehearsal`` for ranks sharing a GPU): a
        point counts as done only by a row of that source, as in the sweep's own plan (``done_keys(source=)``).
        ``done`` (keys with such a row) is brought up to date from the parts not in ``seen`` *after*
        claiming: a sweep appends its row before releasing its claim, so a point claimed here either has
        no row yet or a row this read sees. Both sets are updated in place.
        """
        claims = {name: c for name, k in keys.items() if k not in done and (c := self.claim(k)) is not None}
        new = self.read_new(seen)
        done.update(new.filter(new["source"] == source).select(KEY_COLUMNS).iter_rows())
        for name in [name for name in claims if keys[name] in done]:
            claims.pop(name).release()
        return claims

    def record_plan(self, sweep_id: str, points: int, doing: str = "", *,
                    tally: Mapping[str, object] | None = None) -> None:
        """Say how many points sweep ``sweep_id`` is going to measure and what it is doing now (``"compiling sp
        [16, 256] for T=16"``), for a watcher's progress bar; ``tally``: its whole account of points, reused ones
        included (:meth:`sp_lab.bench.progress.SweepTally.to_dict`)."""
        directory = self.path / PLANS_DIR
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{sweep_id}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"points": int(points), "doing": doing, "tally": tally}))
        os.replace(tmp, directory / f"{sweep_id}.json")

    def plan_tally(self, sweep_id: str) -> dict[str, object] | None:
        """The ``tally`` of sweep ``sweep_id``'s last :meth:`record_plan` (``None``: not planned yet, or none)."""
        try:
            return json.loads((self.path / PLANS_DIR / f"{sweep_id}.json").read_text()).get("tally")
        except FileNotFoundError:
            return None

    def plan_doing(self, sweep_id: str) -> str:
        """What sweep ``sweep_id`` last said it was doing (``""``: nothing said, or no plan)."""
        try:
            return str(json.loads((self.path / PLANS_DIR / f"{sweep_id}.json").read_text()).get("doing", ""))
        except FileNotFoundError:
            return ""

    def planned_points(self, sweep_id: str) -> int | None:
        """The last :meth:`record_plan` of ``sweep_id``, or ``None`` before the sweep has planned."""
        try:
            return int(json.loads((self.path / PLANS_DIR / f"{sweep_id}.json").read_text())["points"])
        except FileNotFoundError:
            return None

    def forget_plan(self, sweep_id: str) -> None:
        """Remove ``sweep_id``'s plan once nobody watches it any more."""
        (self.path / PLANS_DIR / f"{sweep_id}.json").unlink(missing_ok=True)

    # ------------------------------------------------------------------ maintenance
    def compact(self, *, stale_tmp_s: float = 3600.0) -> Path | None:
        """Merge all current parts into one part (atomically), then delete the merged parts.

        Safe beside writers (parts appended meanwhile are left alone) and readers (rows are
        de-duplicated by ``row_id``). Also removes temporary files and sweep plans older than
        ``stale_tmp_s`` (left by crashed writers and watchers). Returns the compacted part, or None if
        there was nothing to merge.
        """
        now = time.time()
        for tmp in [*self.path.glob(".*.tmp"), *self.path.glob(f"{PLANS_DIR}/*")]:
            try:
                if now - tmp.stat().st_mtime > stale_tmp_s:
                    tmp.unlink()
            except FileNotFoundError:
                pass
        parts = self.parts()
        if len(parts) < 2:
            return None
        df = self.read(parts=parts)
        merged = self.append(df)
        for p in parts:
            p.unlink(missing_ok=True)
        return merged

