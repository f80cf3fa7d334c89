"""Headless command line: ``python -m sp_lab <command>`` (also installed as ``sp-lab``).

Commands:

``run``     the whole job on one machine: sweep baseline / sp / sp+async_tp on N ranks, pick the AsyncTP
            threshold, measure the tuned config, export it and write an HTML report (all under --out).
``sweep``   measure latency rows into a store (resumes; spawns --tp ranks, or runs in-rank under torchrun).
``tune``    recommend ``async_tp_min_tokens`` from measured rows (no widget needed).
``export``  write the tuned config file (one JSON per device / tp / model / dtype, with provenance).
``report``  an HTML report: latency curves (fusion-missing and simulated rows marked), provenance,
            the recommendation and, when saved, the split graph of a compiled variant.
``replay``  import recorded rows (a parquet / CSV file or another store) as ``source="replayed"``.

Everything heavy (torch, polars, plotly) is imported inside the command that needs it, so
``python -m sp_lab --help`` answers at once.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_STORE = "data/sweeps"
DEFAULT_TOKENS = "1,2,4,8,16,32,64,128,256,512"
# sp_lab.bench.sweep.VARIANTS, repeated so that parsing never imports torch (a test keeps them equal)
VARIANTS = ("baseline", "sp", "sp+async_tp", "tuned")
REFERENCE_VARIANTS = ("baseline", "sp", "sp+async_tp")
# columns that must agree for rows to be tuned together (one curve per variant)
GROUP_COLUMNS = ("model", "hidden_size", "num_layers", "tp", "dtype", "device_name", "backend", "boundary")


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
        raise argparse.ArgumentTypeError(
            f"unknown variants {bad or text!r}; choose from {', '.join(VARIANTS)}"
        )
    return variants


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_measure_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="toy", help="toy, a preset (llama-3-8b, ...) or a HF checkpoint dir")
    p.add_argument("--tp", type=_positive_int, default=2, help="tensor-parallel ranks (default 2)")
    p.add_argument(
        "--tokens",
        type=_token_list,
        default=_token_list(DEFAULT_TOKENS),
        help=f"token counts, comma-separated (default {DEFAULT_TOKENS})",
    )
    p.add_argument("--num-layers", type=_positive_int, default=None, help="keep only this many layers")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    p.add_argument("--boundary", default=None, help="boundary strategy: none, gather_erase, gather, sharded")
    p.add_argument("--config", type=Path, default=None, help="base LabConfig JSON (default: LabConfig())")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per point (default 3)")
    p.add_argument("--repeats", type=_positive_int, default=10, help="timed calls per point (default 10)")
    p.add_argument("--no-cuda-graph", action="store_true", help="time eager calls on CUDA")
    p.add_argument("--backend", default="auto", help="auto (default), gloo, nccl")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole sweep (default 3600)")


def _add_filter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store", type=Path, default=Path(DEFAULT_STORE), help=f"sweep store (default {DEFAULT_STORE})"
    )
    p.add_argument("--model", default=None, help="only rows of this model")
    p.add_argument("--tp", type=_positive_int, default=None, help="only rows of this tp size")
    p.add_argument("--device-name", default=None, help="only rows measured on this device")
    p.add_argument("--dtype", default=None, help="only rows of this dtype")
    p.add_argument("--boundary", default=None, help="only rows of this boundary strategy")
    p.add_argument(
        "--source",
        choices=("measured", "replayed", "simulated"),
        default=None,
        help="rows to tune on (default: measured, else replayed; simulated only when named)",
    )
    p.add_argument("--skip-corrupt", action="store_true", help="quarantine unreadable part files and go on")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``python -m sp_lab`` (sub-commands run, sweep, tune, export, report, replay)."""
    parser = argparse.ArgumentParser(
        prog="python -m sp_lab",
        description="SP + AsyncTP under piecewise torch.compile: sweep latency, tune the AsyncTP threshold, "
        "export the tuned config, report.",
        epilog="Multi-GPU: torchrun --nproc-per-node N -m sp_lab sweep --tp N ... (each rank runs in place).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="sweep, tune, export and report in one go (the README's main job)")
    _add_measure_args(p)
    p.add_argument("--out", type=Path, default=Path("out"), help="output directory (default ./out)")
    p.add_argument("--store", type=Path, default=None, help="sweep store (default OUT/sweeps; reruns resume)")
    p.add_argument("--no-validate", action="store_true", help="do not measure the tuned config")
    p.add_argument("--cdn", action="store_true", help="load plotly.js from its CDN (smaller, needs internet)")

    p = sub.add_parser("sweep", help="measure latency rows into a store (resumes where it stopped)")
    _add_measure_args(p)
    p.add_argument(
        "--variants",
        type=_variant_list,
        default=list(REFERENCE_VARIANTS),
        help="comma-separated: baseline, sp, sp+async_tp, tuned (default the first three)",
    )
    p.add_argument(
        "--store", type=Path, default=Path(DEFAULT_STORE), help=f"sweep store (default {DEFAULT_STORE})"
    )
    p.add_argument(
        "--reports-dir", type=Path, default=None, help="save each variant's CompileReport JSON here"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("tune", help="recommend async_tp_min_tokens from measured rows")
    _add_filter_args(p)
    p.add_argument("--json", type=Path, default=None, help="also write the recommendation as JSON here")

    p = sub.add_parser("export", help="write the tuned config file (threshold from --threshold or the rows)")
    _add_filter_args(p)
    p.add_argument("--config", type=Path, default=None, help="base LabConfig JSON (default: LabConfig())")
    p.add_argument(
        "--threshold", type=_positive_int, default=None, help="async_tp_min_tokens (default: tune)"
    )
    p.add_argument(
        "--out", type=Path, default=Path("configs"), help="directory for the file (default ./configs)"
    )

    p = sub.add_parser("report", help="write an HTML report of the rows")
    _add_filter_args(p)
    p.add_argument(
        "--out", type=Path, default=Path("out/report.html"), help="HTML file (default out/report.html)"
    )
    p.add_argument(
        "--compile-report", type=Path, default=None, help="a CompileReport JSON to draw as a graph"
    )
    p.add_argument("--cdn", action="store_true", help="load plotly.js from its CDN (smaller, needs internet)")

    p = sub.add_parser("replay", help="import recorded rows (parquet, CSV or a store) as source='replayed'")
    p.add_argument("source", type=Path, help="a .parquet / .csv file or a store directory")
    p.add_argument(
        "--store", type=Path, default=Path(DEFAULT_STORE), help=f"destination (default {DEFAULT_STORE})"
    )
    return parser


# ---------------------------------------------------------------------------------------------- helpers
def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _base_config(args: argparse.Namespace) -> Any:
    from sp_lab.config import LabConfig

    config = LabConfig.from_json(args.config) if args.config else LabConfig(tp_size=args.tp)
    changes: dict[str, Any] = {"tp_size": args.tp}
    if getattr(args, "boundary", None):
        changes["boundary"] = args.boundary
    import dataclasses

    return dataclasses.replace(config, **changes)


def _sweep(
    args: argparse.Namespace,
    *,
    store: Path,
    variants: Sequence[str],
    config: Any,
    reports_dir: Path | None,
    progress: bool,
) -> Any:
    """Measure ``variants`` into ``store``: in place under torchrun, else on ``args.tp`` spawned ranks."""
    from sp_lab.bench.sweep import launch_sweep, run_sweep

    kwargs = {
        "token_counts": args.tokens,
        "variants": list(variants),
        "config": config,
        "store_dir": str(store),
        "dtype": args.dtype,
        "num_layers": args.num_layers,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "cuda_graph": not args.no_cuda_graph,
        "reports_dir": str(reports_dir) if reports_dir else None,
    }
    if _under_torchrun():
        from sp_lab.distributed.launch import init_from_env

        init_from_env(args.backend, timeout=args.timeout)
        return run_sweep(args.model, tp_size=args.tp, progress=progress, **kwargs)
    return launch_sweep(
        args.model,
        world_size=args.tp,
        backend=args.backend,
        timeout=args.timeout,
        progress=progress,
        **kwargs,
    )


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _load_rows(store: Path, *, skip_corrupt: bool = False) -> Any:
    from sp_lab.bench.store import CorruptPartError, SweepStore

    if not Path(store).is_dir():
        raise CliError(f"no sweep store at {store}: run `python -m sp_lab sweep --store {store}` first")
    try:
        df = SweepStore(store).read(skip_corrupt=skip_corrupt)
    except CorruptPartError as e:
        raise CliError(
            str(e).replace("read(skip_corrupt=True) (CLI: --skip-corrupt)", "--skip-corrupt")
        ) from e
    if df.height == 0:
        raise CliError(f"the sweep store {store} has no rows yet")
    return df


def _filter_rows(df: Any, args: argparse.Namespace) -> Any:
    import polars as pl

    for col in ("model", "tp", "device_name", "dtype", "boundary"):
        value = getattr(args, col, None)
        if value is not None:
            df = df.filter(pl.col(col) == value)
    if df.height == 0:
        raise CliError("no rows match the filters (--model/--tp/--device-name/--dtype/--boundary)")
    return df


def _one_group(df: Any) -> Any:
    """The rows if they come from one (model, tp, dtype, device, ...) group, else a CliError listing them."""
    groups = df.select(GROUP_COLUMNS).unique().sort(GROUP_COLUMNS)
    if groups.height > 1:
        listing = "\n  ".join(
            ", ".join(
                f"{k}={v}" for k, v in row.items() if k in ("model", "tp", "dtype", "device_name", "boundary")
            )
            for row in groups.iter_rows(named=True)
        )
        raise CliError(
            f"rows from {groups.height} different setups; a threshold is tuned for one. Pick one with "
            f"--model/--tp/--device-name/--dtype/--boundary:\n  {listing}"
        )
    return df


def data_hash(df: Any) -> str:
    """Hash of the rows a decision was made from (their sorted row ids), recorded as provenance."""
    ids = sorted(df["row_id"].to_list())
    return hashlib.sha1("\n".join(ids).encode()).hexdigest()[:16]


def _recommend(df: Any) -> Any:
    """:func:`sp_lab.tuning.threshold.recommend_threshold` on one source's rows (a ``Recommendation``)."""
    from sp_lab.tuning.threshold import recommend_threshold

    try:
        return recommend_threshold(df)
    except ValueError as e:  # e.g. no baseline rows: the message says what to measure
        raise CliError(f"cannot recommend a threshold: {e}") from e


def _recommendation_dict(rec: Any) -> dict[str, Any]:
    return {
        "async_tp_min_tokens": rec.threshold,
        "never_fuse": rec.never_fuse,
        "total_regret": rec.total_regret,
        "max_rel_regret": rec.max_rel_regret,
    }


def _describe(rec: Any) -> str:
    """The recommendation's one-line summary and its candidate table (threshold -> regret)."""
    import polars as pl

    with pl.Config(tbl_rows=-1, tbl_hide_dataframe_shape=True, float_precision=4):
        return f"{rec.summary()}\n{rec.candidates}"


def _one_source(df: Any, source: str | None = None) -> Any:
    """Rows of one source: ``source`` if given, else the measured rows, else the replayed ones.

    Simulated rows are tuned on only when named: a threshold from the what-if model must never
    pass for a measured one.
    """
    import polars as pl

    present = sorted(df["source"].unique().to_list())
    if source is None:
        source = next((s for s in ("measured", "replayed") if s in present), None)
        if source is None:
            raise CliError(
                f"no measured or replayed rows (sources here: {present}); pass --source simulated "
                "to tune on the what-if model's rows"
            )
    if source not in present:
        raise CliError(f"no rows with source={source!r}; sources here: {present}")
    return df.filter(pl.col("source") == source)


def tuned_config(base: Any, threshold: int, *, never_fuse: bool = False, tp_size: int | None = None) -> Any:
    """``base`` gated at ``threshold`` (SP + AsyncTP from there on), or with both off for "never fuse"."""
    import dataclasses

    tp = {"tp_size": tp_size} if tp_size is not None else {}
    if never_fuse:
        return dataclasses.replace(base, enable_sp=False, enable_async_tp=False, **tp)
    threshold = min(threshold, base.max_num_tokens)
    return dataclasses.replace(
        base, enable_sp=True, enable_async_tp=True, async_tp_min_tokens=threshold, **tp
    )


def _export(df: Any, base: Any, threshold: int, out_dir: Path, recommendation: Any = None) -> Path:
    """Write the tuned config for the (single-setup) rows ``df``; returns the file."""
    from sp_lab.config import export_tuned_config

    row = df.row(0, named=True)
    never = bool(recommendation is not None and recommendation.never_fuse)
    tuned = tuned_config(base, threshold, never_fuse=never, tp_size=int(row["tp"]))
    extra: dict[str, Any] = {
        "sweep_rows": df.height,
        "source": row["source"],
        "backend": row["backend"],
        "boundary": row["boundary"],
    }
    if recommendation is not None:
        extra["recommendation"] = _recommendation_dict(recommendation)
    return export_tuned_config(
        tuned,
        directory=out_dir,
        device_name=row["device_name"],
        model_spec={"name": row["model"], "hidden_size": row["hidden_size"], "num_layers": row["num_layers"]},
        dtype=row["dtype"],
        data_hash=data_hash(df),
        extra_provenance=extra,
    )


def _html_table(df: Any, columns: Sequence[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
        for row in df.select(columns).iter_rows()
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}"
    "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px}"
    ".warn{background:#fff3cd;padding:.5em 1em;border-left:4px solid #e0a800}"
)


def write_report(
    df: Any,
    out: Path,
    *,
    recommendation: Any = None,
    compile_report: Path | None = None,
    include_plotlyjs: bool | str = True,
) -> Path:
    """One HTML page: latency curves, what ran, provenance, recommendation, optional split graph."""
    import polars as pl

    from sp_lab.viz.latency import plot_latency

    threshold = recommendation.threshold if recommendation is not None else None
    figures = [plot_latency(df, async_tp_min_tokens=threshold, title="Forward latency vs tokens")]
    if compile_report is not None:
        from sp_lab.viz.graph import load_report, plot_overview

        figures.append(plot_overview(load_report(compile_report)))
    divs = [
        f.to_html(full_html=False, include_plotlyjs=include_plotlyjs if i == 0 else False)
        for i, f in enumerate(figures)
    ]
    prov_cols = [
        "source",
        "model",
        "hidden_size",
        "num_layers",
        "tp",
        "dtype",
        "device_name",
        "device_count",
        "backend",
        "boundary",
        "torch_version",
        "sp_lab_version",
        "hostname",
        "timing_method",
    ]
    provenance = df.group_by(prov_cols).agg(pl.len().alias("rows")).sort(prov_cols)
    ran = (
        df.group_by("reported_variant", "source")
        .agg(
            pl.len().alias("rows"),
            pl.col("sp_rewrites").max().alias("sp_rewrites (max)"),
            pl.col("n_fused_ag_mm").max().alias("fused AG+mm (max)"),
            pl.col("n_fused_mm_rs").max().alias("fused mm+RS (max)"),
            pl.col("fusion_missing").sum().alias("fusion missing"),
        )
        .sort("reported_variant")
    )
    parts = [
        f"<h1>sp_lab report</h1><p>{df.height} rows, {df['timestamp'].min()} to {df['timestamp'].max()}.</p>"
    ]
    missing = int(df["fusion_missing"].sum())
    if missing:
        parts.append(
            f"<p class='warn'>{missing} row(s) expected SP or AsyncTP fusion that did not run. They are drawn "
            "and listed as '&lt;variant&gt; [fusion missing]', never as the variant they were asked to be.</p>"
        )
    if (df["source"] == "simulated").any():
        parts.append("<p class='warn'>Some rows are <b>simulated</b> (what-if model), not measured.</p>")
    if recommendation is not None:
        parts.append(
            f"<h2>Recommended async_tp_min_tokens</h2><pre>{html.escape(_describe(recommendation))}</pre>"
        )
    parts += [
        *divs,
        "<h2>What ran</h2>",
        _html_table(ran, ran.columns),
        "<h2>Provenance</h2>",
        _html_table(provenance, provenance.columns),
    ]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>sp_lab report</title>"
        f"<style>{_CSS}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n",
        encoding="utf-8",
    )
    return out


# ---------------------------------------------------------------------------------------------- commands
def cmd_sweep(args: argparse.Namespace) -> int:
    result = _sweep(
        args,
        store=args.store,
        variants=args.variants,
        config=_base_config(args),
        reports_dir=args.reports_dir,
        progress=not args.no_progress,
    )
    if _is_rank0():
        print(
            f"sweep: {len(result.rows)} row(s) measured, {result.skipped} already in the store -> {args.store}"
        )
        if result.fusion_missing:
            print(
                f"warning: {len(result.fusion_missing)} row(s) flagged fusion_missing "
                "(the variant's SP rewrite or fusion did not run)"
            )
    return 0


def _tuning_rows(args: argparse.Namespace) -> Any:
    df = _load_rows(args.store, skip_corrupt=args.skip_corrupt)
    return _one_group(_one_source(_filter_rows(df, args), args.source))


def cmd_tune(args: argparse.Namespace) -> int:
    df = _tuning_rows(args)
    rec = _recommend(df)
    print(_describe(rec))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {**_recommendation_dict(rec), "data_hash": data_hash(df), "rows": df.height}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"recommendation -> {args.json}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from sp_lab.config import LabConfig

    df = _tuning_rows(args)
    rec = _recommend(df) if args.threshold is None else None
    threshold = args.threshold if rec is None else rec.threshold
    base = LabConfig.from_json(args.config) if args.config else LabConfig()
    path = _export(df, base, threshold, args.out, rec)
    what = (
        "SP and AsyncTP off (never fuse)"
        if rec is not None and rec.never_fuse
        else f"async_tp_min_tokens={threshold}"
    )
    print(f"tuned config ({what}) -> {path}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    df = _filter_rows(_load_rows(args.store, skip_corrupt=args.skip_corrupt), args)
    rec = None
    try:
        rec = _recommend(_one_group(_one_source(df, args.source)))
    except CliError as e:  # several setups, no baseline, ...: the report is still worth having
        print(f"note: the report has no threshold recommendation: {e}")
    path = write_report(
        df,
        args.out,
        recommendation=rec,
        compile_report=args.compile_report,
        include_plotlyjs="cdn" if args.cdn else True,
    )
    print(f"report -> {path}")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    import polars as pl

    from sp_lab.bench.store import NULLABLE_COLUMNS, ROW_SCHEMA, SweepStore

    src: Path = args.source
    if src.is_dir():
        df = SweepStore(src).read()
    elif src.suffix == ".parquet":
        df = pl.read_parquet(src)
    elif src.suffix == ".csv":
        df = pl.read_csv(src, schema_overrides={c: t for c, t in ROW_SCHEMA.items()})
    else:
        raise CliError(f"cannot replay {src}: expected a store directory, a .parquet or a .csv file")
    if df.height == 0:
        raise CliError(f"{src} holds no rows")
    missing = sorted(set(ROW_SCHEMA) - set(df.columns) - NULLABLE_COLUMNS - {"schema_version", "row_id"})
    if missing:
        raise CliError(f"{src} lacks columns {missing}; recorded rows must carry full provenance")
    # measured rows become "replayed"; simulated rows stay "simulated" (never unlabelled)
    is_sim = pl.col("source") == "simulated"
    df = df.with_columns(source=pl.when(is_sim).then(pl.lit("simulated")).otherwise(pl.lit("replayed")))
    store = SweepStore(args.store)
    if "row_id" in df.columns:  # keep the recorded ids: replaying the same file twice adds nothing
        df = df.filter(~pl.col("row_id").is_in(store.read()["row_id"].implode()))
    rows = df.select([c for c in ROW_SCHEMA if c in df.columns]).to_dicts()
    store.append(rows)
    print(f"replay: {len(rows)} new row(s) from {src} -> {args.store}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    out: Path = args.out
    store = args.store or out / "sweeps"
    reports = out / "compile_reports"
    config = _base_config(args)
    print(
        f"[1/5] sweep {', '.join(REFERENCE_VARIANTS)}: {args.model}, tp={args.tp}, "
        f"{len(args.tokens)} token counts -> {store}",
        flush=True,
    )
    _sweep(args, store=store, variants=REFERENCE_VARIANTS, config=config, reports_dir=reports, progress=True)

    rec = None
    if _is_rank0():
        df = _one_group(_one_source(_load_rows(store), "measured"))
        rec = _recommend(df)
        print(f"[2/5] tune: {_describe(rec)}", flush=True)
    # under torchrun every rank must measure the same tuned config: rank 0's choice goes to all
    threshold, never = _broadcast((rec.threshold, rec.never_fuse) if rec is not None else None)
    tuned = tuned_config(config, threshold, never_fuse=never)
    if args.no_validate:
        print("[3/5] tuned config not measured (--no-validate)")
    else:
        if _is_rank0():
            gate = (
                f"async_tp_min_tokens={tuned.async_tp_min_tokens}" if tuned.enable_sp else "SP, AsyncTP off"
            )
            print(f"[3/5] measure the tuned config ({gate})", flush=True)
        _sweep(args, store=store, variants=["tuned"], config=tuned, reports_dir=reports, progress=True)
    if not _is_rank0():
        return 0

    df = _one_group(_one_source(_load_rows(store), "measured"))
    path = _export(df, config, threshold, out, rec)
    print(f"[4/5] tuned config -> {path}")
    overview = reports / "sp+async_tp.json"
    html_path = write_report(
        df,
        out / "report.html",
        recommendation=rec,
        compile_report=overview if overview.exists() else None,
        include_plotlyjs="cdn" if args.cdn else True,
    )
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


COMMANDS = {
    "run": cmd_run,
    "sweep": cmd_sweep,
    "tune": cmd_tune,
    "export": cmd_export,
    "report": cmd_report,
    "replay": cmd_replay,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m sp_lab`` / ``sp-lab``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from sp_lab.distributed.launch import LaunchError  # imported late: it pulls in torch

        if not isinstance(e, LaunchError):
            raise
        # a rank failed (or timed out) inside sp_lab.launch; the message quotes the rank's traceback
        print(
            f"error: {e}\n\nRows measured before the failure are kept; rerun the same command to resume.",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print(
            "interrupted: rows already measured are kept; rerun the same command to resume", file=sys.stderr
        )
        return 130
