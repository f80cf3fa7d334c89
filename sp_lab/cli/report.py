"""``report``: an HTML report: recommendation first, latency with intervals, regret, what ran, provenance."""

from __future__ import annotations

import argparse
from pathlib import Path

from sp_lab.cli import rows
from sp_lab.cli.arguments import add_filter_args
from sp_lab.cli.errors import CliError
from sp_lab.vocabulary import DEFAULT_REPORT

HELP = "write an HTML report of the rows"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_filter_args(p)
    p.add_argument("--out", type=Path, default=None, help=f"HTML file (default {DEFAULT_REPORT} in the project)")
    p.add_argument("--compile-report", type=Path, default=None, help="a CompileReport JSON to draw as a graph")
    p.add_argument("--cdn", action="store_true", help="load plotly.js from its CDN (smaller, needs internet)")
    p.add_argument("--force", action="store_true", help="replace --out even if it reports another store's rows")


def run(args: argparse.Namespace) -> int:
    from sp_lab.viz.sweep_report import ReportOverwriteError, write_report

    df = rows.load_rows(args.store, skip_corrupt=args.skip_corrupt)
    rec, setup = None, None
    try:  # the setup as tune and export choose it (among the rows tuned on), so all three report the same one
        tuning, choice = rows.one_setup(rows.one_source(df, args.source), rows.asked_setup(args))
        setup = choice.setup
        rec = rows.recommend(tuning, rows.base_config(args, tuning))
    except CliError as e:  # no measured rows, no baseline, ...: the report is still worth having
        print(f"note: the report has no recommendation: {e}")
    if setup is None:  # no rows to tune on: the setup asked for (or the newest) among all rows
        setup = rows.one_setup(df, rows.asked_setup(args))[1].setup
    try:
        path = write_report(df, args.out, store=args.store, recommendation=rec, compile_report=args.compile_report,
                            include_plotlyjs="cdn" if args.cdn else True, overwrite=args.force, setup=setup)
    except ReportOverwriteError as e:
        raise CliError(str(e)) from e
    print(f"report -> {path}")
    return 0
