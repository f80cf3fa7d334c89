"""``predict``: the performance model's curves, crossover and config for GPUs that are not here (``source:
predicted``), or ``--validate``: the model against published multi-GPU figures."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sp_lab.cli import rows
from sp_lab.cli.arguments import positive_int, token_list
from sp_lab.cli.errors import CliError

HELP = ("predicted curves, crossover and config for GPUs that are not here (source: predicted), or --validate: "
        "the model against published figures")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3-70b", help="preset to predict (default llama-3-70b)")
    p.add_argument("--tp", type=positive_int, default=8, help="tensor-parallel size (default 8)")
    p.add_argument("--gpu", default="h200_sxm",
                   help="a system with collected tables (h100_sxm, h200_sxm, b200_sxm, b300_sxm, a100_sxm, l40s, "
                   "rtx_pro_6000_server; gb200 and gb300 up to tp 4; h100, h200, b200 are aliases) or one modelled "
                   "only (h100_pcie, h800, h100-hbm2e); default h200_sxm")
    p.add_argument("--nccl-version", default=None, help="collected NCCL table version (default: the newest)")
    p.add_argument("--vllm-version", default=None, help="collected vLLM table version (default: the newest)")
    p.add_argument("--modelled-only", action="store_true",
                   help="ignore the collected tables (aiconfigurator-core): every term modelled")
    p.add_argument("--cross-check", action="store_true",
                   help="print the baseline beside NVIDIA AIConfigurator's estimate (Llama 3.1 70B, tp 8, h200_sxm)")
    p.add_argument("--dtype", default="bfloat16",
                   help="matmul dtype: bfloat16, fp8 (rowwise scales, as vLLM) or fp8-tensorwise (as torchtitan)")
    p.add_argument("--tokens", type=token_list, default=None, help="comma-separated token counts for the curves")
    p.add_argument("--rule", type=Path, default=None, help="a per-matmul rule JSON for the 'tuned' curve "
                   "(default: the rule the model implies)")
    p.add_argument("--validate", action="store_true", help="print the model against published multi-GPU figures")
    p.add_argument("--write", type=Path, default=None, help="with --validate: also write the page (docs/predictions.md)")
    p.add_argument("--export-predicted", type=Path, default=None, metavar="DIR",
                   help="write the predicted config to DIR, marked source=predicted (measured rows should decide)")


def run(args: argparse.Namespace) -> int:
    from sp_lab.tuning.predict import advice, validation

    if args.cross_check:
        from sp_lab.tuning.predict.crosscheck import cross_check_markdown, cross_check_table

        print(cross_check_markdown(cross_check_table()))
        return 0
    if args.validate:
        from sp_lab.tuning.predict.crosscheck import cross_check_markdown, cross_check_table
        from sp_lab.tuning.predict.measured import tp1_comparison, tp1_markdown

        table = validation.validation_table()
        print(validation.validation_markdown(table))
        print("Beside an independent estimator (AIConfigurator):\n")
        print(cross_check_markdown(cross_check_table()))
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
        prediction = advice.predict(args.model, args.tp, args.gpu, dtype=args.dtype, nccl_version=args.nccl_version,
                                    vllm_version=args.vllm_version, collected_tables=not args.modelled_only, **kwargs)
    except ValueError as e:
        raise CliError(str(e)) from e
    print(prediction.text())
    if args.export_predicted is not None:
        path = rows.export(prediction.rows, prediction.config(), args.export_predicted,
                           chosen_in="python -m sp_lab predict (source: predicted)", allow_predicted=True)
        print(f"wrote {path} (source: predicted -- not measured)")
    return 0
