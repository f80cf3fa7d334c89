"""``run``: the whole job on one machine, the README's main job.

Sweep baseline / sp / sp+async_tp interleaved on N ranks, pick the policy (which program below / above a
threshold) with its confidence, measure the tuned config, export it and write an HTML report (all under --out).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sp_lab.cli import rows
from sp_lab.cli.arguments import OUT_HELP, add_measure_args, add_vllm_arg
from sp_lab.cli.errors import CliError
from sp_lab.cli.ranks import broadcast, is_rank0, sweep
from sp_lab.programs import REFERENCE_VARIANTS
from sp_lab.vocabulary import DEFAULT_OUT, DEFAULT_REPORT, DEFAULT_STORE, MEASURED, TUNED

HELP = "sweep, tune, export and report in one go (the README's main job)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_measure_args(p, budget=60.0)  # keeps `make run` to a few minutes on 2 shared cores
    p.add_argument("--out", type=Path, default=None, help=OUT_HELP)
    p.add_argument("--store", type=Path, default=None, help="sweep store (default OUT/sweeps; reruns resume)")
    p.add_argument("--no-validate", action="store_true", help="do not measure the tuned config")
    p.add_argument("--cdn", action="store_true", help="load plotly.js from its CDN (smaller, needs internet)")
    p.add_argument("--force", action="store_true", help="replace OUT/report.html even if another store made it")
    add_vllm_arg(p)


def run(args: argparse.Namespace) -> int:
    from sp_lab.programs import Policy

    out: Path = args.out
    store = args.store or out / Path(DEFAULT_STORE).relative_to(DEFAULT_OUT)
    reports = out / "compile_reports"
    config = rows.base_config(args)
    print(f"[1/5] sweep {', '.join(REFERENCE_VARIANTS)} interleaved: {args.model}, tp={args.tp}, "
          f"{len(args.tokens)} token counts -> {store}", flush=True)
    swept = sweep(args, store=store, variants=REFERENCE_VARIANTS, config=config, reports_dir=reports, progress=True)

    rec = None
    if is_rank0():  # this run's setup alone, whatever else the store holds (notebooks share it)
        df = rows.one_setup(rows.one_source(rows.load_rows(store), MEASURED), swept.setup)[0]
        rec = rows.recommend(df, config)
        print(f"[2/5] tune: {rec.describe()}", flush=True)
    # under torchrun every rank must measure the same tuned config: rank 0's choice goes to all
    steps = broadcast(rec.policy.steps if rec is not None else None)
    tuned = Policy(steps).to_config(config)
    if args.no_validate:
        print("[3/5] tuned config not measured (--no-validate)")
    else:
        if is_rank0():
            print(f"[3/5] measure the tuned config ({Policy(steps).name})", flush=True)
        sweep(args, store=store, variants=[TUNED], config=tuned, reports_dir=reports, progress=True)
    if not is_rank0():
        return 0
    from sp_lab.serving.on_rows import serving_answer
    from sp_lab.tuning.export import describe_file
    from sp_lab.viz.sweep_report import ReportOverwriteError, write_report

    df = rows.one_setup(rows.one_source(rows.load_rows(store), MEASURED), swept.setup)[0]
    # the report's serving section on the same rows (chat traffic, budget the largest count they cover); rows that
    # cannot price a serving step give the reason, written into the file
    path = rows.export(df, tuned, out, recommendation=rec, chosen_in="python -m sp_lab run",
                       vllm_release=args.vllm_release, traffic=serving_answer(df, config=tuned))
    print(f"[4/5] {describe_file(path)}")
    overview = reports / "sp+async_tp.json"
    try:
        html_path = write_report(df, out / Path(DEFAULT_REPORT).relative_to(DEFAULT_OUT), store=store,
                                 recommendation=rec, compile_report=overview if overview.exists() else None,
                                 include_plotlyjs="cdn" if args.cdn else True, overwrite=args.force)
    except ReportOverwriteError as e:
        raise CliError(str(e)) from e
    print(f"[5/5] report -> {html_path}")
    print(f"rows -> {store} (rerun to resume); compile reports -> {reports}")
    return 0
