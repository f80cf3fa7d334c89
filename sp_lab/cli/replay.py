"""``replay``: import recorded rows (a parquet / CSV file or another store) as ``source="replayed"``."""

from __future__ import annotations

import argparse
from pathlib import Path

from sp_lab.cli.errors import CliError
from sp_lab.vocabulary import DEFAULT_STORE

HELP = "import recorded rows (parquet, CSV or a store) as source='replayed'"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", type=Path, help="a .parquet / .csv file or a store directory")
    p.add_argument("--store", type=Path, default=None, help=f"destination (default {DEFAULT_STORE} in the project)")


def run(args: argparse.Namespace) -> int:
    from sp_lab.bench.replay import ReplayError, import_recorded

    try:
        added = import_recorded(args.source, args.store)
    except ReplayError as e:
        raise CliError(str(e)) from e
    print(f"replay: {added} new row(s) from {args.source} -> {args.store}")
    return 0
