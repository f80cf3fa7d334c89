"""Headless command line: ``python -m sp_lab <command>`` (also installed as ``sp-lab``).

Commands:

``run``     the whole job on one machine: sweep baseline / sp / sp+async_tp interleaved on N ranks, pick the
            policy (which program below / above a threshold) with its confidence, measure the tuned
            config, export it and write an HTML report (all under --out).
``sweep``   measure latency rows into a store (resumes; spawns --tp ranks, or runs in-rank under torchrun).
``tune``    recommend a policy from measured rows (no widget needed).
``export``  write the tuned config file (one JSON per device / tp / model / dtype, with provenance).
``report``  an HTML report: recommendation first, latency with intervals, regret, what ran, provenance.
``replay``  import recorded rows (a parquet / CSV file or another store) as ``source="replayed"``.
``predict`` the performance model's curves, crossover and config for GPUs that are not here (``source:
            predicted``), or ``--validate``: the model against published multi-GPU figures.

Every command reads and writes the same default store (``out/sweeps`` in the project: see :mod:`sp_lab.paths`,
the notebooks and the tuner use the same) and says which one it used. The
work is done in the library (:mod:`sp_lab.bench`, :mod:`sp_lab.tuning`, :mod:`sp_lab.viz`); this
module only parses arguments and calls it. Everything heavy (torch, polars, plotly) is imported inside
the command that needs it, so ``python -m sp_lab --help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sp_lab.config import BoundaryStrategy, ConfigError
from sp_lab.programs import REFERENCE_VARIANTS, VARIANTS
from sp_lab.vocabulary import (
    DEFAULT_OUT,
    DEFAULT_REPORT,
    DEFAULT_STORE,
    MEASURED,
    NEVER,
    SETUP_COLUMNS,
    SOURCES,
    TUNABLE_SOURCES,
    TUNED,
)

if TYPE_CHECKING:
    import polars as pl

    from sp_lab.config import LabConfig
    from sp_lab.tuning.policy import Recommendation

DEFAULT_TOKENS = "1,2,4,8,16,32,64,128,256,512"
_STORE_HELP = (f"sweep store (default {DEFAULT_STORE} in the project: the nearest directory up from here with a "
               "pyproject.toml or .git; SP_LAB_OUT names another output folder)")
_OUT_HELP = f"output directory (default {DEFAULT_OUT}/ in the project; SP_LAB_OUT names another)"


class CliError(Exception):
    """A problem the user can fix; printed without a traceback, exit status 2."""


# ---------------------------------------------------------------------------------------------- parsing
def _token_list(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts like 1,16,128, got {text!r}")
    if not counts or any(t < 1 for t in counts):
        raise argparse.ArgumentTypeError(f"token counts must be positive integers, got {text!r}")
    return counts


def _variant_list(text: str) -> list[str]:
    variants = [v for v in text.replace(" ", "").split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise argparse.ArgumentTypeError(f"unknown variants {bad or text!r}; choose from {', '.join(VARIANTS)}")
    return variants


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _threshold(text: str) -> int | None:
    return None if text == NEVER else _positive_int(text)


def _add_measure_args(p: argparse.ArgumentParser, *, budget: float | None = None) -> None:
    p.add_argument("--model", default="toy", help="toy, a preset (llama-3-8b, ...) or a HF checkpoint dir")
    p.add_argument("--tp", type=_positive_int, default=2, help="tensor-parallel ranks (default 2)")
    p.add_argument("--tokens", type=_token_list, default=_token_list(DEFAULT_TOKENS),
                   help=f"token counts, comma-separated (default {DEFAULT_TOKENS})")
    p.add_argument("--num-layers", type=_positive_int, default=None, help="keep only this many layers")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    p.add_argument("--boundary", default=None, choices=[b.value for b in BoundaryStrategy],
                   help=f"boundary strategy: {BoundaryStrategy.names()}")
    p.add_argument("--config", type=Path, default=None, help="base LabConfig JSON (default: LabConfig())")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per point (default 3)")
    p.add_argument("--repeats", type=_positive_int, default=10, help="least timed calls per point (default 10)")
    p.add_argument("--max-repeats", type=_positive_int, default=None, help="most timed calls per point (10x)")
    p.add_argument("--ci-width", type=float, default=0.05,
                   help="stop once each median's 95%% interval is this fraction of it (default 0.05)")
    p.add_argument("--budget", type=float, default=budget,
                   help=f"seconds of timing per sweep, shared by its token counts (default {budget or 'none'})")
    p.add_argument("--no-cuda-graph", action="store_true", help="time eager calls on CUDA")
    p.add_argument("--backend", default="auto", help="auto (default), gloo, nccl")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole sweep (default 3600)")


def _add_filter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", type=Path, default=None, help=_STORE_HELP)
    p.add_argument("--model", default=None, help="only rows of this model")
    p.add_argument("--tp", type=_positive_int, default=None, help="only rows of this tp size")
    p.add_argument("--device-name", default=None, help="only rows measured on this device")
    p.add_argument("--dtype", default=None, help="only rows of this dtype")
    p.add_argument("--boundary", default=None, help="only rows of this boundary strategy")
    p.add_argument("--source", choices=SOURCES, default=None,
                   help="rows to tune on (default: measured, else replayed; others only when named)")
    p.add_argument("--skip-corrupt", action="store_true", help="quarantine unreadable part files and go on")


def _vllm_release(text: str) -> str:
    """``--vllm-release``: the table's version, resolved while parsing (a release the table cannot place fails
    before any sweep); a build or patch read as another table entry is said on stderr."""
    from sp_lab.vllm_releases import resolve_release

    try:
        rel, note = resolve_release(text)
    except KeyError as e:
        raise argparse.ArgumentTypeError(e.args[0]) from None
    if note is not None:
        print(f"note: {note}", file=sys.stderr)
    return rel.version


def _add_vllm_arg(p: argparse.ArgumentParser) -> None:
    from sp_lab.vllm_releases import DEFAULT_RELEASE

    p.add_argument("--vllm-release", type=_vllm_release, default=None,
                   help="vLLM release the file's vllm section is written for, e.g. 0.18 or 0.31.0 (default: the "
                   f"installed vLLM, else the newest known, {DEFAULT_RELEASE})")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``python -m sp_lab`` (sub-commands run, sweep, tune, export, report, replay, predict)."""
    parser = argparse.ArgumentParser(
        prog="python -m sp_lab",
        description="SP + AsyncTP under piecewise torch.compile: sweep latency, tune the policy, export the "
        "tuned config, report.",
        epilog="Multi-GPU: torchrun --nproc-per-node N -m sp_lab sweep --tp N ... (each rank runs in place).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="sweep, tune, export and report in one go (the README's main job)")
    _add_measure_args(p, budget=60.0)  # keeps `make run` to a few minutes on 2 shared cores
    p.add_argument("--out", type=Path, default=None, help=_OUT_HELP)
    p.add_argument("--store", type=Path, default=None, help="sweep store (default OUT/sweeps; reruns resume)")
    p.add_argument("--no-validate", action="store_true", help="do not measure the tuned config")
    p.add_argument("--cdn", action="store_true", help="load plotly.js from its CDN (smaller, needs internet)")
    p.add_argument("--force", action="store_true", help="replace OUT/report.html even if another store made it")
    _add_vllm_arg(p)

    p = sub.add_parser("sweep", help="measure latency rows into a store (resumes where it stopped)")
    _add_measure_args(p)
    p.add_argument("--variants", type=_variant_list, default=list(REFERENCE_VARIANTS),
                   help="comma-separated: baseline, sp, sp+async_tp, tuned (default the first three)")
    p.add_argument("--store", type=Path, default=None, help=_STORE_HELP)
    p.add_argument("--reports-dir", type=Path, default=None, help="save each variant's CompileReport JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("tune", help="recommend a policy (and async_tp_min_tokens) from measured rows")
    _add_filter_args(p)
    p.add_argument("--json", type=Path, default=None, help="also write the recommendation as JSON here")

    p = sub.add_parser("export", help="write the tuned config file (from --threshold or the recommendation)")
    _add_filter_args(p)
    p.add_argument("--config", type=Path, default=None, help="base LabConfig JSON (default: LabConfig())")
    p.add_argument("--threshold", type=_threshold, default=argparse.SUPPRESS,
                   help="baseline below, sp+async_tp from this token count; 'never' for SP and AsyncTP off "
                   "(default: the recommended policy)")
    p.add_argument("--out", type=Path, default=None, help=f"directory for the file (default {DEFAULT_OUT}/ in the project)")
    p.add_argument("--matmul-rows", type=Path, default=None,
                   help="per-matmul fused/unfused rows (.parquet or .csv, as measure_matmuls writes them) for the "
                   "model-level gates per shape (default: the layer sweep's gate for every matmul)")
    _add_vllm_arg(p)

    p = sub.add_parser("report", help="write an HTML report of the rows")
    _add_filter_args(p)
    p.add_argument("--out", type=Path, default=None, help=f"HTML file (default {DEFAULT_REPORT} in the project)")
    p.add_argument("--compile-report", type=Path, default=None, help="a CompileReport JSON to draw as a graph")
    p.add_argument("--cdn", action="store_true", help="load plotly.js from its CDN (smaller, needs internet)")
    p.add_argument("--force", action="store_true", help="replace --out even if it reports another store's rows")

    p = sub.add_parser("predict", help="predicted curves, crossover and config for GPUs that are not here "
                       "(source: predicted), or --validate: the model against published figures")
    p.add_argument("--model", default="llama-3-70b", help="preset to predict (default llama-3-70b)")
    p.add_argument("--tp", type=_positive_int, default=8, help="tensor-parallel size (default 8)")
    p.add_argument("--gpu", default="h200", help="h100, h100-hbm2e, h100-pcie, h200, h800 or b200 (default h200)")
    p.add_argument("--dtype", default="bfloat16",
                   help="matmul dtype: bfloat16, fp8 (rowwise scales, as vLLM) or fp8-tensorwise (as torchtitan)")
    p.add_argument("--tokens", type=_token_list, default=None, help="comma-separated token counts for the curves")
    p.add_argument("--rule", type=Path, default=None, help="a per-matmul rule JSON for the 'tuned' curve "
                   "(default: the rule the model implies)")
    p.add_argument("--validate", action="store_true", help="print the model against published multi-GPU figures")
    p.add_argument("--write", type=Path, default=None, help="with --validate: also write the page (docs/predictions.md)")
    p.add_argument("--export-predicted", type=Path, default=None, metavar="DIR",
                   help="write the predicted config to DIR, marked source=predicted (measured rows should decide)")

    p = sub.add_parser("replay", help="import recorded rows (parquet, CSV or a store) as source='replayed'")
    p.add_argument("source", type=Path, help="a .parquet / .csv file or a store directory")
    p.add_argument("--store", type=Path, default=None, help=f"destination (default {DEFAULT_STORE} in the project)")
    return parser


# ---------------------------------------------------------------------------------------------- plumbing
def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _base_config(args: argparse.Namespace, rows: pl.DataFrame | None = None) -> LabConfig:
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


def _sweep(args: argparse.Namespace, *, store: Path, variants: Sequence[str], config: LabConfig,
           reports_dir: Path | None, progress: bool) -> Any:
    """Measure ``variants`` into ``store``: in place under torchrun, else on ``args.tp`` spawned ranks."""
    from sp_lab.bench.sweep import SweepArgumentError, launch_sweep, run_sweep

    kwargs = {"token_counts": args.tokens, "variants": list(variants), "config": config, "store_dir": str(store),
              "dtype": args.dtype, "num_layers": args.num_layers, "warmup": args.warmup, "repeats": args.repeats,
              "max_repeats": args.max_repeats, "ci_width": args.ci_width, "budget_s": args.budget,
              "cuda_graph": not args.no_cuda_graph, "reports_dir": str(reports_dir) if reports_dir else None}
    try:
        if _under_torchrun():
            from sp_lab.distributed.launch import init_from_env

            init_from_env(args.backend, timeout=args.timeout)
            return run_sweep(args.model, tp_size=args.tp, progress=progress, **kwargs)
        return launch_sweep(args.model, world_size=args.tp, backend=args.backend, timeout=args.timeout,
                            progress=progress, **kwargs)
    except SweepArgumentError as e:  # refused before any rank started: nothing to resume
        raise CliError(str(e)) from None


def _load_rows(store: Path, *, skip_corrupt: bool = False) -> pl.DataFrame:
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


def _filter_rows(df: pl.DataFrame, args: argparse.Namespace) -> pl.DataFrame:
    import polars as pl

    for col in ("model", "tp", "device_name", "dtype", "boundary"):
        value = getattr(args, col, None)
        if value is not None:
            df = df.filter(pl.col(col) == value)
    if df.height == 0:
        raise CliError("no rows match the filters (--model/--tp/--device-name/--dtype/--boundary)")
    return df


def _one_group(df: pl.DataFrame) -> pl.DataFrame:
    """The rows if they come from one (model, tp, dtype, device, ...) setup, else a CliError listing them."""
    groups = df.select(SETUP_COLUMNS).unique().sort(SETUP_COLUMNS)
    if groups.height > 1:
        shown = ("model", "tp", "dtype", "device_name", "boundary")
        listing = "\n  ".join(", ".join(f"{k}={r[k]}" for k in shown) for r in groups.iter_rows(named=True))
        raise CliError(f"rows from {groups.height} different setups; a policy is tuned for one. Pick one with "
                       f"--model/--tp/--device-name/--dtype/--boundary:\n  {listing}")
    return df


def _one_source(df: pl.DataFrame, source: str | None = None) -> pl.DataFrame:
    """Rows of ``source``, else the measured rows, else the replayed ones (others only when named: --source)."""
    from sp_lab.tuning.regret import one_source

    try:
        return one_source(df, source, prefer=TUNABLE_SOURCES, option="--source ")
    except ValueError as e:
        raise CliError(str(e)) from None


def _recommend(df: pl.DataFrame, base: LabConfig) -> Recommendation:
    import polars as pl

    from sp_lab.tuning.policy import recommend

    try:
        return recommend(df.filter(pl.col("variant").is_in(list(REFERENCE_VARIANTS))), base)
    except ValueError as e:  # e.g. no baseline rows: the message says what to measure
        raise CliError(f"cannot recommend a policy: {e}") from e


def _tuning_rows(args: argparse.Namespace) -> pl.DataFrame:
    df = _load_rows(args.store, skip_corrupt=args.skip_corrupt)
    return _one_group(_one_source(_filter_rows(df, args), args.source))


# ---------------------------------------------------------------------------------------------- commands
def cmd_sweep(args: argparse.Namespace) -> int:
    result = _sweep(args, store=args.store, variants=args.variants, config=_base_config(args),
                    reports_dir=args.reports_dir, progress=not args.no_progress)
    if _is_rank0():
        print(f"sweep: {len(result.rows)} row(s) measured, {result.skipped} already in the store -> {args.store}")
        if result.fusion_missing:
            print(f"warning: {len(result.fusion_missing)} row(s) flagged fusion_missing "
                  "(the variant's SP rewrite or fusion did not run)")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from sp_lab.tuning.export import data_hash, threshold_text

    df = _tuning_rows(args)
    rec = _recommend(df, _base_config(args, df))
    print(f"{rec.describe()}\nasync_tp_min_tokens={threshold_text(rec.config)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {**rec.to_dict(), "data_hash": data_hash(df), "rows": df.height}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"recommendation -> {args.json}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from sp_lab.tuning.export import describe_file
    from sp_lab.tuning.policy import Policy
    from sp_lab.vocabulary import BASELINE, SP_ASYNC_TP

    df = _tuning_rows(args)
    base = _base_config(args, df)
    rec = None
    if hasattr(args, "threshold"):
        if args.threshold is not None and args.threshold > base.max_num_tokens:
            raise CliError(f"--threshold {args.threshold} is above max_num_tokens={base.max_num_tokens}"
                           f"{f' of --config {args.config}' if args.config else ''}: SP + AsyncTP would never run. "
                           f"Give a threshold of at most {base.max_num_tokens}, or --threshold never for SP and "
                           "AsyncTP off")
        config = Policy.gate(BASELINE, SP_ASYNC_TP, args.threshold).to_config(base)
    else:
        rec = _recommend(df, base)
        config = rec.config
    path = _export(df, config, args.out, recommendation=rec, chosen_in="python -m sp_lab export",
                   vllm_release=args.vllm_release, matmul_rows=_matmul_rows(args.matmul_rows))
    print(describe_file(path))
    return 0


def _export(rows: pl.DataFrame, config: LabConfig, out: Path, **kwargs: Any) -> Path:
    """:func:`sp_lab.tuning.export.export_config`, its refusals (predicted rows, no rows) as user errors."""
    from sp_lab.tuning.export import ExportError, export_config

    try:
        return export_config(rows, config, out, **kwargs)
    except ExportError as e:
        raise CliError(str(e)) from None


def _matmul_rows(path: Path | None) -> pl.DataFrame | None:
    import polars as pl

    if path is None:
        return None
    if not path.is_file() or path.suffix not in (".parquet", ".csv"):
        raise CliError(f"--matmul-rows {path}: expected a .parquet or .csv file of per-matmul rows "
                       "(sp_lab.tuning.microbench.measure_matmuls)")
    rows = pl.read_parquet(path) if path.suffix == ".parquet" else pl.read_csv(path)
    need = ("name", "side", "k", "n", "dtype", "tp", "m", "fused_us", "unfused_us")
    missing = [c for c in need if c not in rows.columns]
    if missing:
        raise CliError(f"--matmul-rows {path}: lacks columns {missing} (measure_matmuls writes them)")
    return rows


def cmd_report(args: argparse.Namespace) -> int:
    from sp_lab.viz.sweep_report import ReportOverwriteError, write_report

    df = _filter_rows(_load_rows(args.store, skip_corrupt=args.skip_corrupt), args)
    rec = None
    try:
        tuning = _one_group(_one_source(df, args.source))
        rec = _recommend(tuning, _base_config(args, tuning))
    except CliError as e:  # several setups, no baseline, ...: the report is still worth having
        print(f"note: the report has no recommendation: {e}")
    try:
        path = write_report(df, args.out, store=args.store, recommendation=rec, compile_report=args.compile_report,
                            include_plotlyjs="cdn" if args.cdn else True, overwrite=args.force)
    except ReportOverwriteError as e:
        raise CliError(str(e)) from e
    print(f"report -> {path}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from sp_lab.bench.replay import ReplayError, import_recorded

    try:
        added = import_recorded(args.source, args.store)
    except ReplayError as e:
        raise CliError(str(e)) from e
    print(f"replay: {added} new row(s) from {args.source} -> {args.store}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from sp_lab.tuning.policy import Policy

    out: Path = args.out
    store = args.store or out / Path(DEFAULT_STORE).relative_to(DEFAULT_OUT)
    reports = out / "compile_reports"
    config = _base_config(args)
    print(f"[1/5] sweep {', '.join(REFERENCE_VARIANTS)} interleaved: {args.model}, tp={args.tp}, "
          f"{len(args.tokens)} token counts -> {store}", flush=True)
    _sweep(args, store=store, variants=REFERENCE_VARIANTS, config=config, reports_dir=reports, progress=True)

    rec = None
    if _is_rank0():
        rec = _recommend(_one_group(_one_source(_load_rows(store), MEASURED)), config)
        print(f"[2/5] tune: {rec.describe()}", flush=True)
    # under torchrun every rank must measure the same tuned config: rank 0's choice goes to all
    steps = _broadcast(rec.policy.steps if rec is not None else None)
    tuned = Policy(steps).to_config(config)
    if args.no_validate:
        print("[3/5] tuned config not measured (--no-validate)")
    else:
        if _is_rank0():
            print(f"[3/5] measure the tuned config ({Policy(steps).name})", flush=True)
        _sweep(args, store=store, variants=[TUNED], config=tuned, reports_dir=reports, progress=True)
    if not _is_rank0():
        return 0
    from sp_lab.tuning.export import describe_file
    from sp_lab.viz.sweep_report import ReportOverwriteError, write_report

    df = _one_group(_one_source(_load_rows(store), MEASURED))
    path = _export(df, tuned, out, recommendation=rec, chosen_in="python -m sp_lab run",
                   vllm_release=args.vllm_release)
    print(f"[4/5] {describe_file(path)}")
    overview = reports / "sp+async_tp.json"
    try:
        html_path = write_report(df, out / Path(DEFAULT_REPORT).relative_to(DEFAULT_OUT), store=store, recommendation=rec,
                                 compile_report=overview if overview.exists() else None,
                                 include_plotlyjs="cdn" if args.cdn else True, overwrite=args.force)
    except ReportOverwriteError as e:
        raise CliError(str(e)) from e
    print(f"[5/5] report -> {html_path}")
    print(f"rows -> {store} (rerun to resume); compile reports -> {reports}")
    return 0


def _broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank under torchrun; ``value`` itself otherwise."""
    if not _under_torchrun():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def cmd_predict(args: argparse.Namespace) -> int:
    """``predict``: the performance model's curves / crossover / config, or its validation table."""
    from sp_lab.tuning.predict import advice, validation

    if args.validate:
        from sp_lab.tuning.predict.measured import tp1_comparison, tp1_markdown

        table = validation.validation_table()
        print(validation.validation_markdown(table))
        print("Beside measured rows of the same setup:\n")
        print(tp1_markdown(tp1_comparison()))
        if args.write is not None:
            args.write.parent.mkdir(parents=True, exist_ok=True)
            args.write.write_text(validation.predictions_page(table))
            print(f"wrote {args.write}")
        return 0
    try:
        kwargs: dict[str, Any] = {"tokens": args.tokens} if args.tokens else {}
        if args.rule is not None:
            from sp_lab.rules import MatmulRule

            kwargs["rule"] = MatmulRule.from_json(args.rule)
        prediction = advice.predict(args.model, args.tp, args.gpu, dtype=args.dtype, **kwargs)
    except ValueError as e:
        raise CliError(str(e)) from e
    print(prediction.text())
    if args.export_predicted is not None:
        path = _export(prediction.rows, prediction.config(), args.export_predicted,
                       chosen_in="python -m sp_lab predict (source: predicted)", allow_predicted=True)
        print(f"wrote {path} (source: predicted -- not measured)")
    return 0


COMMANDS = {"run": cmd_run, "sweep": cmd_sweep, "tune": cmd_tune, "export": cmd_export, "report": cmd_report,
            "replay": cmd_replay, "predict": cmd_predict}


def _fill_defaults(args: argparse.Namespace) -> None:
    """The project's output folder, store and report (:mod:`sp_lab.paths`) where the command line named none, and
    the vLLM release an export is for (the installed vLLM's, else the newest known), resolved before any work."""
    from sp_lab.paths import default_out, default_report, default_store

    if getattr(args, "out", False) is None:
        args.out = default_report() if args.command == "report" else default_out()
    if getattr(args, "store", False) is None and args.command != "run":  # run: OUT/sweeps
        args.store = default_store()
    if getattr(args, "vllm_release", False) is None:
        from sp_lab.vllm_releases import DEFAULT_RELEASE, installed_release, target_release

        try:
            target_release()  # the installed vLLM, checked before any work
        except KeyError as e:
            raise CliError(f"{e.args[0]}; name a release to write for with --vllm-release") from None
        # As installed (0.19.1+cu128): the export's notes then say how the table read it.
        args.vllm_release = installed_release() or DEFAULT_RELEASE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m sp_lab`` / ``sp-lab``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        _fill_defaults(args)
        return COMMANDS[args.command](args)
    except (CliError, ConfigError) as e:  # ConfigError: a bad --config file or value, the message names it
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        from sp_lab.models.registry import UnknownModelError  # imported late: the registry reads presets

        if not isinstance(e, UnknownModelError):
            raise  # a crash, not a typo: keep its traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from sp_lab.distributed.launch import LaunchError  # imported late: it pulls in torch

        if not isinstance(e, LaunchError):
            raise
        # a rank failed (or timed out) inside sp_lab.launch; the message quotes the rank's traceback
        print(f"error: {e}\n\nRows measured before the failure are kept; rerun the same command to resume.",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: rows already measured are kept; rerun the same command to resume", file=sys.stderr)
        return 130
