"""Recorded rows from elsewhere (another machine's store, a parquet or CSV file): one loader for all callers.

:func:`read_recorded` reads them as they are; :func:`read_as_replayed` labels timings measured elsewhere
``source="replayed"`` (rows a model computed keep their source, ``"predicted"`` or ``"simulated"``: a model's
numbers are never relabelled as timings, which the tuner would tune on), as the tuner shows them;
:func:`import_recorded` adds those rows to a store, keeping their ``row_id`` so that importing a file twice adds
nothing.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from sp_lab.bench.store import NULLABLE_COLUMNS, ROW_SCHEMA, SweepStore
from sp_lab.vocabulary import MEASURED, REPLAYED


class ReplayError(ValueError):
    """Recorded rows that cannot be read or lack provenance; the message names the file and the fix."""


def read_recorded(path: str | Path) -> pl.DataFrame:
    """Rows of a store directory, a ``.parquet`` or a ``.csv`` file (CSV columns typed as :data:`ROW_SCHEMA`).

    A relative ``path`` that does not exist here is looked up in the project too
    (:func:`sp_lab.paths.resolve_in_project`): ``"out/sweeps"`` works from a notebook in ``notebooks/``.
    """
    from sp_lab.paths import project_root, resolve_in_project

    src = resolve_in_project(path)
    if not src.exists():
        places = sorted({str(Path.cwd()), str(project_root())})
        raise ReplayError(f"cannot replay {path}: it does not exist (looked in {' and '.join(places)}); give a "
                          "sweep store directory, a .parquet or a .csv file (the default store is filled by "
                          "`python -m sp_lab sweep` or `make run`)")
    if src.is_dir():
        df = SweepStore(src).read()
    elif src.suffix == ".parquet":
        df = pl.read_parquet(src)
    elif src.suffix == ".csv":
        df = pl.read_csv(src, schema_overrides=dict(ROW_SCHEMA))
    else:
        raise ReplayError(f"cannot replay {src}: expected a store directory, a .parquet or a .csv file")
    if df.height == 0:
        raise ReplayError(f"{src} holds no rows: run a sweep first (`python -m sp_lab sweep --store {src}`, "
                          "or the tuner's Run sweep) or replay another store")
    return df


def read_as_replayed(path: str | Path) -> pl.DataFrame:
    """The rows of ``path`` (:func:`read_recorded`), measured ones labelled replayed (other sources keep theirs);
    rows without full provenance are refused."""
    df = read_recorded(path)
    missing = sorted(set(ROW_SCHEMA) - set(df.columns) - NULLABLE_COLUMNS - {"schema_version", "row_id"})
    if missing:
        raise ReplayError(f"{path} lacks columns {missing}; recorded rows must carry full provenance")
    # Only a measurement becomes "replayed" (a timing recorded elsewhere, tunable); a model's rows and rehearsal
    # rows (several ranks on one GPU: not the multi-GPU program's timing) keep their own source.
    measured = pl.col("source") == MEASURED
    return df.with_columns(source=pl.when(measured).then(pl.lit(REPLAYED)).otherwise(pl.col("source")))


def import_recorded(path: str | Path, store: str | Path) -> int:
    """Append the rows of ``path`` to the store at ``store``, as :func:`read_as_replayed` labels them; returns how
    many were new."""
    df = read_as_replayed(path)
    dest = SweepStore(store)
    if "row_id" in df.columns:  # keep the recorded ids: replaying the same file twice adds nothing
        df = df.filter(~pl.col("row_id").is_in(dest.read()["row_id"].implode()))
    rows = df.select([c for c in ROW_SCHEMA if c in df.columns]).to_dicts()
    dest.append(rows)
    return len(rows)
