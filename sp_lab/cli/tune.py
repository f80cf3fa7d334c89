"""``tune``: recommend a policy (which program below and above a threshold) from measured rows."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sp_lab.cli import rows
from sp_lab.cli.arguments import add_filter_args

HELP = "recommend a policy (and async_tp_min_tokens) from measured rows"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_filter_args(p)
    p.add_argument("--json", type=Path, default=None, help="also write the recommendation as JSON here")


def run(args: argparse.Namespace) -> int:
    from sp_lab.bench.store import data_hash
    from sp_lab.tuning.export import threshold_text

    df = rows.tuning_rows(args)
    rec = rows.recommend(df, rows.base_config(args, df))
    print(f"{rec.describe()}\nasync_tp_min_tokens={threshold_text(rec.config)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {**rec.to_dict(), "data_hash": data_hash(df), "rows": df.height}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"recommendation -> {args.json}")
    return 0
