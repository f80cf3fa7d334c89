"""Measured multi-GPU sweeps against the performance model, and the numbers issue #7's closing note asks for.

    python benchmarks/multigpu/compare.py data/multigpu/multigpu_rows.parquet --out data/multigpu/compare

Reads measured rows (``source="measured"``, the parquet ``benchmarks/multigpu/plan.py`` returns or any sweep
store folder), and for every setup (model, tp, boundary, layers, dtype, device):

1. predicts the same sweep with :func:`sp_lab.tuning.predict.layer.predict_layers` (``source="predicted"``:
   matmul times from the shipped H200 tables, a roofline fitted to them where a shape is missing, which the
   ``matmul_model`` column says; the fused kernels as chunk pipelines; ``--gpu`` picks the GPU and its
   interconnect) and reports the error **per point**. Two errors per point, because the model leaves out
   embedding, LM head and its logits all_gather (attention is included): ``rel_error`` on the latency
   itself, and ``delta_error_us`` on the variant's saving over ``baseline`` at the same token count,
   where the shared parts cancel;
2. the speedup of ``sp+async_tp`` over ``baseline`` per token count;
3. the tuned threshold (``async_tp_min_tokens`` of the measured ``tuned`` rows, next to what
   :func:`recommend_threshold` picks from the reference rows and vLLM's rule);
4. the regret of the tuned config at every token count (``sp_lab.tuning.regret.regret_table``), beside what
   the tuned rows themselves measured.

Writes ``prediction_errors.csv``, ``speedup.csv``, ``thresholds.csv``, ``regret.csv`` and ``comparison.md``
(all of it as Markdown tables) to ``--out``, and prints the Markdown.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import polars as pl

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without installing

from sp_lab.config import LabConfig
from sp_lab.models.registry import resolve_config
from sp_lab.tuning.policy import recommend
from sp_lab.tuning.predict.hardware import gpu_names
from sp_lab.tuning.predict.kernels import MatmulTable, dtype_bytes
from sp_lab.tuning.predict.layer import Target, predict_layers
from sp_lab.tuning.predict.measured import compare_to_measured
from sp_lab.tuning.regret import regret_table
from sp_lab.vllm_releases import vllm_sp_min_token_num
from sp_lab.vocabulary import describe_threshold

SETUP = ("model", "tp", "boundary", "num_layers", "dtype", "hidden_size", "device_name")
REFERENCE = ("baseline", "sp", "sp+async_tp")


def load_measured(path: Path) -> pl.DataFrame:
    """Measured rows from a parquet file or a sweep-store folder; fusion-missing rows are kept (flagged)."""
    if path.is_dir():
        from sp_lab.bench.store import SweepStore

        df = SweepStore(path).read()
    else:
        df = pl.read_parquet(path)
    df = df.filter(pl.col("source") == "measured")
    if df.height == 0:
        raise SystemExit(f"{path} holds no measured rows (source='measured')")
    return df


def _predicted_tuned(pred: pl.DataFrame, measured: pl.DataFrame) -> pl.DataFrame:
    """Predicted ``tuned`` rows: the measured tuned config's gate applied to the predicted reference curves.

    Below ``async_tp_min_tokens`` (or everywhere when the tuned config has SP off) the tuned config runs the
    baseline program, from there on SP + AsyncTP.
    """
    tuned = measured.filter(pl.col("variant") == "tuned")
    if tuned.height == 0:
        return pred.clear()
    gate = tuned.select("num_tokens", "enable_sp", "async_tp_min_tokens").unique("num_tokens")
    wide = pred.filter(pl.col("variant").is_in(["baseline", "sp+async_tp"])).join(gate, on="num_tokens")
    fused = pl.col("enable_sp") & (pl.col("num_tokens") >= pl.col("async_tp_min_tokens"))
    chosen = wide.filter(pl.when(fused).then(pl.col("variant") == "sp+async_tp")
                         .otherwise(pl.col("variant") == "baseline"))
    return chosen.drop("enable_sp", "async_tp_min_tokens").with_columns(variant=pl.lit("tuned"))


def predict_for(setup: dict, tokens: list[int], table: MatmulTable, gpu: str, *,
                collected_tables: bool = True) -> tuple[pl.DataFrame, str]:
    """The predicted sweep for one measured setup (bf16), and which matmul model served it: the system's collected
    tables where aiconfigurator-core has them (``collected_tables=False``: the shipped H200 tables alone)."""
    spec = resolve_config(setup["model"], num_layers=int(setup["num_layers"]))
    pred = predict_layers(spec, int(setup["tp"]), tokens, Target.of(gpu, collected_tables=collected_tables),
                          num_layers=int(setup["num_layers"]),
                          table=table, full_layer=True)
    return pred, matmul_model(pred["estimated_shapes"][0])


def matmul_model(estimated_shapes: str) -> str:
    """Which matmul times served a prediction: the collected GEMM table of the system (aiconfigurator-core, where
    installed), the shipped H200 tables, or the roofline fitted to them for a shape those lack (e.g. llama-2-7b's
    11008-wide MLP)."""
    if estimated_shapes.startswith("none (collected"):
        return "collected table"
    return "h200 table" if estimated_shapes == "none" else "roofline fit"


def prediction_errors(measured: pl.DataFrame, table: MatmulTable, gpu: str = "h200", *,
                      collected_tables: bool = True) -> pl.DataFrame:
    """Per setup, variant and token count: measured vs predicted latency and saving over baseline."""
    frames = []
    for setup_rows in measured.partition_by(list(SETUP), maintain_order=True):
        setup = setup_rows.row(0, named=True)
        tokens = sorted(setup_rows["num_tokens"].unique().to_list())
        pred, how = predict_for(setup, tokens, table, gpu, collected_tables=collected_tables)
        pred = pl.concat([pred, _predicted_tuned(pred, setup_rows)], how="vertical_relaxed")
        cmp = compare_to_measured(pred, setup_rows, on=("num_tokens", "variant"))
        base = cmp.filter(pl.col("variant") == "baseline").select(
            "num_tokens", base_pred=pl.col("predicted_us"), base_meas=pl.col("measured_us"))
        cmp = cmp.join(base, on="num_tokens", how="left").with_columns(
            predicted_delta_us=pl.col("predicted_us") - pl.col("base_pred"),
            measured_delta_us=pl.col("measured_us") - pl.col("base_meas"),
        ).with_columns(delta_error_us=pl.col("predicted_delta_us") - pl.col("measured_delta_us")).drop(
            "base_pred", "base_meas")
        frames.append(cmp.with_columns(
            **{k: pl.lit(setup[k]) for k in ("model", "tp", "boundary", "num_layers", "device_name")},
            matmul_model=pl.lit(how), comm_model=pl.lit(pred["interconnect"][0])))
    cols = ["model", "tp", "boundary", "num_layers", "variant", "num_tokens", "measured_us", "predicted_us",
            "error_us", "rel_error", "measured_delta_us", "predicted_delta_us", "delta_error_us", "matmul_model",
            "comm_model", "device_name"]
    return pl.concat(frames, how="vertical_relaxed").select(cols).sort("model", "tp", "boundary", "variant",
                                                                       "num_tokens")


def _wide(measured: pl.DataFrame) -> pl.DataFrame:
    """One row per (setup, token count), one latency column per variant (median over repeats of a point;
    fusion-missing rows dropped: they time another program)."""
    ok = measured.filter(~pl.col("fusion_missing"))
    return ok.pivot(on="variant", index=[*SETUP, "num_tokens"], values="latency_us",
                    aggregate_function="median").sort(*SETUP, "num_tokens")


def speedups(measured: pl.DataFrame) -> pl.DataFrame:
    """``baseline / sp+async_tp`` (and ``baseline / sp``) per setup and token count: > 1 means faster."""
    wide = _wide(measured)
    need = [v for v in ("baseline", "sp", "sp+async_tp") if v in wide.columns]
    if "baseline" not in need or "sp+async_tp" not in need:
        return pl.DataFrame()
    out = wide.select("model", "tp", "boundary", "num_tokens", *need).with_columns(
        speedup_sp_async_tp=pl.col("baseline") / pl.col("sp+async_tp"))
    if "sp" in need:
        out = out.with_columns(speedup_sp=pl.col("baseline") / pl.col("sp"))
    return out


def _tuned_config(setup_rows: pl.DataFrame) -> LabConfig | None:
    tuned = setup_rows.filter(pl.col("variant") == "tuned")
    return LabConfig.from_json(tuned["config_json"][0]) if tuned.height else None


def thresholds(measured: pl.DataFrame) -> pl.DataFrame:
    """Per setup: the tuned config's threshold, what the reference rows recommend, and vLLM's rule."""
    rows = []
    for setup_rows in measured.partition_by(list(SETUP), maintain_order=True):
        setup = setup_rows.row(0, named=True)
        tuned_cfg = _tuned_config(setup_rows)
        if tuned_cfg is not None:
            measured_thr = describe_threshold(tuned_cfg.async_tp_min_tokens if tuned_cfg.enable_sp else None)
        else:
            measured_thr = None
        try:
            rec = recommend(setup_rows.filter(pl.col("variant").is_in(REFERENCE)),
                            tuned_cfg or LabConfig(tp_size=int(setup["tp"])))
            recommended = describe_threshold(rec.threshold)
        except ValueError as e:
            recommended = f"n/a ({e})"
        rows.append({
            "model": setup["model"], "tp": setup["tp"], "boundary": setup["boundary"],
            "tuned_async_tp_min_tokens": str(measured_thr),
            "recommended_from_rows": str(recommended),
            "vllm_sp_min_token_num": str(vllm_sp_min_token_num(
                int(setup["hidden_size"]), dtype_bytes(setup["dtype"]), int(setup["tp"]))),
        })
    return pl.DataFrame(rows)


def regret(measured: pl.DataFrame) -> pl.DataFrame:
    """Regret of the tuned config at every token count (:func:`sp_lab.tuning.regret.regret_table`, the one
    regret), beside the tuned rows' own latency: ``tuned_vs_run`` = measured tuned / the variant it runs - 1
    checks that measuring the tuned config reproduces the program it is made of."""
    parts = []
    for setup_rows in measured.partition_by(list(SETUP), maintain_order=True):
        tuned_cfg = _tuned_config(setup_rows)
        if tuned_cfg is None:
            continue
        ok = setup_rows.filter(~pl.col("fusion_missing"))
        table = regret_table(ok.filter(pl.col("variant").is_in(REFERENCE)), tuned_cfg, warn=False)
        tuned = (ok.filter(pl.col("variant") == "tuned").group_by("num_tokens")
                 .agg(tuned_us=pl.col("latency_us").median()))
        setup = setup_rows.row(0, named=True)
        parts.append(table.join(tuned, on="num_tokens", how="left").with_columns(
            model=pl.lit(setup["model"]), tp=pl.lit(setup["tp"]), boundary=pl.lit(setup["boundary"]),
            tuned_vs_run=pl.col("tuned_us") / pl.col("latency_us") - 1))
    if not parts:
        return pl.DataFrame()
    return pl.concat(parts).select("model", "tp", "boundary", pl.exclude("model", "tp", "boundary"))


def markdown(df: pl.DataFrame, floats: int = 3) -> str:
    """A GitHub Markdown table of ``df``."""
    if df.height == 0:
        return "_(no rows)_\n"

    def cell(v: object) -> str:
        return f"{v:.{floats}f}" if isinstance(v, float) else str(v)

    head = "| " + " | ".join(df.columns) + " |\n|" + "---|" * len(df.columns) + "\n"
    return head + "".join("| " + " | ".join(cell(v) for v in row) + " |\n" for row in df.iter_rows())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", type=Path, help="measured rows: a .parquet file or a sweep-store folder")
    parser.add_argument("--out", type=Path, default=Path("out/multigpu_compare"), help="output folder")
    parser.add_argument("--gpu", default="h200", choices=gpu_names(),
                        help="GPU (and its interconnect) the prediction is for")
    args = parser.parse_args(argv)
    measured = load_measured(args.rows)
    errors = prediction_errors(measured, MatmulTable.default(), args.gpu)
    tables = {"speedup": speedups(measured), "thresholds": thresholds(measured), "regret": regret(measured),
              "prediction_errors": errors}
    args.out.mkdir(parents=True, exist_ok=True)
    for name, df in tables.items():
        if df.height:
            df.write_csv(args.out / f"{name}.csv", float_precision=4)
    summary = errors.group_by("model", "tp", "boundary", "variant").agg(
        points=pl.len(),
        median_abs_rel_error=pl.col("rel_error").abs().median(),
        max_abs_rel_error=pl.col("rel_error").abs().max(),
        median_abs_delta_error_us=pl.col("delta_error_us").abs().median(),
    ).sort("model", "tp", "boundary", "variant")
    text = (
        f"# Multi-GPU sweeps vs the performance model\n\nRows: `{args.rows}` ({measured.height} measured). "
        f"Predictions: `sp_lab.tuning.predict` for {args.gpu} (source: predicted; embedding and LM head "
        "excluded, so `rel_error` is biased low; `delta_error_us` compares savings over baseline, where they "
        "cancel; model and its validation: docs/predictions.md).\n\n"
        "## Speedup of sp+async_tp over baseline\n\n" + markdown(tables["speedup"])
        + "\n## Tuned threshold per model and tp\n\n" + markdown(tables["thresholds"])
        + "\n## Regret of the tuned config at every token count\n\n" + markdown(tables["regret"])
        + "\n## Prediction error, summary\n\n" + markdown(summary)
        + "\n## Prediction error per point\n\n" + markdown(errors.drop("comm_model", "device_name"), floats=1)
    )
    (args.out / "comparison.md").write_text(text)
    print(text)
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
