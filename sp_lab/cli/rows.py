"""Rows a command works on: read from the store, one source and one setup (the one the flags ask for, else the
newest: :func:`sp_lab.bench.setups.select_setup`, said on stdout with the others); and the library calls on them
whose refusals are user errors (recommend, export)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sp_lab.cli.errors import CliError
from sp_lab.programs import REFERENCE_VARIANTS
from sp_lab.vocabulary import TUNABLE_SOURCES

if TYPE_CHECKING:
    from collections.abc import Mapping

    import polars as pl

    from sp_lab.bench.setups import Setup, SetupChoice
    from sp_lab.config import LabConfig
    from sp_lab.tuning.policy import Recommendation


def base_config(args: argparse.Namespace, rows: pl.DataFrame | None = None) -> LabConfig:
    """``--config`` (or ``LabConfig()``) at the tp of ``--tp``, or of ``rows`` when given."""
    from sp_lab.config import LabConfig

    path = getattr(args, "config", None)
    try:
        config = LabConfig.from_json(path) if path else LabConfig()
    except FileNotFoundError as e:
        raise CliError(f"--config: {e}") from None
    tp = int(rows["tp"][0]) if rows is not None else args.tp
    changes: dict[str, Any] = {"tp_size": tp} if tp else {}
    if getattr(args, "boundary", None):
        changes["boundary"] = args.boundary
    return dataclasses.replace(config, **changes)


def load_rows(store: Path, *, skip_corrupt: bool = False) -> pl.DataFrame:
    """Every row of ``store``; a missing or empty store says how to fill it."""
    from sp_lab.bench.store import CorruptPartError, SweepStore

    if not Path(store).is_dir():
        raise CliError(f"no sweep store at {store}: run `python -m sp_lab sweep --store {store}` first")
    try:
        df = SweepStore(store).read(skip_corrupt=skip_corrupt)
    except CorruptPartError as e:
        raise CliError(str(e).replace("read(skip_corrupt=True) (CLI: --skip-corrupt)", "--skip-corrupt")) from e
    if df.height == 0:
        raise CliError(f"the sweep store {store} has no rows yet: run a sweep first, e.g. "
                       f"`python -m sp_lab sweep --store {store} --model toy --tp 2` (or `make run`)")
    print(f"rows: {df.height} from {store}")
    return df


def asked_setup(args: argparse.Namespace) -> dict[str, object]:
    """The setup fields the flags ask for: ``--setup`` and its shorthands ``--model/--tp/--device-name/--dtype/
    --boundary`` (empty: the newest setup)."""
    asked: dict[str, object] = dict(getattr(args, "setup", None) or {})
    for field in ("model", "tp", "device_name", "dtype", "boundary"):
        value = getattr(args, field, None)
        if value is not None:
            asked[field] = value
    return asked


def one_setup(df: pl.DataFrame, asked: Setup | Mapping[str, object] | None) -> tuple[pl.DataFrame, SetupChoice]:
    """The rows of one setup (``asked``, else the newest), said on stdout with the others and their row counts;
    a setup that is not there is a CliError listing those that are."""
    from sp_lab.bench.setups import SetupNotFoundError, select_setup

    try:
        rows, choice = select_setup(df, asked or None, style="cli")
    except SetupNotFoundError as e:
        raise CliError(str(e)) from None
    print(choice.message("cli"))
    return rows, choice


def one_source(df: pl.DataFrame, source: str | None = None) -> pl.DataFrame:
    """Rows of ``source``, else the measured rows, else the replayed ones (others only when named: --source)."""
    from sp_lab.tuning.regret import one_source as pick_source

    try:
        return pick_source(df, source, prefer=TUNABLE_SOURCES, option="--source ")
    except ValueError as e:
        raise CliError(str(e)) from None


def tuning_rows(args: argparse.Namespace) -> pl.DataFrame:
    """The rows ``tune`` and ``export`` decide on: one source, one setup (asked for by the flags, else the newest)."""
    df = load_rows(args.store, skip_corrupt=args.skip_corrupt)
    return one_setup(one_source(df, args.source), asked_setup(args))[0]


def recommend(df: pl.DataFrame, base: LabConfig) -> Recommendation:
    """The recommended policy on the reference variants' rows; a refusal says what to measure."""
    import polars as pl

    from sp_lab.tuning.policy import recommend as recommend_policy

    try:
        return recommend_policy(df.filter(pl.col("variant").is_in(list(REFERENCE_VARIANTS))), base)
    except ValueError as e:  # e.g. no baseline rows: the message says what to measure
        raise CliError(f"cannot recommend a policy: {e}") from e


def export(rows: pl.DataFrame, config: LabConfig, out: Path, **kwargs: Any) -> Path:
    """:func:`sp_lab.tuning.export.export_config`, its refusals (predicted rows, no rows) as user errors."""
    from sp_lab.tuning.export import ExportError, export_config

    try:
        return export_config(rows, config, out, **kwargs)
    except ExportError as e:
        raise CliError(str(e)) from None
