"""``traffic``: does SP + AsyncTP pay on this traffic? Steps of a vLLM-style scheduler priced per policy from
measured rows (``--store``) or predicted ones, TTFT / TPOT, the speedup against baseline as a ratio, or
``--validate``: the serving answer against the seed's result and AIConfigurator (``sp_lab.serving``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from sp_lab.cli.arguments import STORE_HELP, positive_int
from sp_lab.cli.errors import CliError

HELP = ("does SP + AsyncTP pay on this traffic: a vLLM-style schedule priced per policy, speedup vs baseline, "
        "TTFT/TPOT (predicted or measured), or --validate")


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests per second (a number > 0, or inf), got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the rate must be > 0 requests per second, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sp_lab.serving.workloads import workload_names

    p.add_argument("--model", default="llama-3-70b", help="preset (default llama-3-70b)")
    p.add_argument("--tp", type=positive_int, default=8, help="tensor-parallel size (default 8)")
    p.add_argument("--gpu", default="h200", help="GPU of the predicted rows and the modelled KV / LM-head reads "
                   "(default h200)")
    p.add_argument("--dtype", default=None, help="matmul dtype of the rows (predicted: default bfloat16; measured: "
                   "the store's, when it holds one)")
    p.add_argument("--workload", default="chat", help=f"named workload: {', '.join(workload_names())} (default chat)")
    p.add_argument("--requests", type=positive_int, default=1000, help="requests to sample (default 1000)")
    p.add_argument("--rate", type=_rate, default=None, help="Poisson arrivals at this many requests/s")
    p.add_argument("--concurrency", type=positive_int, default=None,
                   help="at most this many requests in flight (vllm bench serve --max-concurrency); default 64 "
                        "when no --rate is given")
    p.add_argument("--trace", type=Path, default=None, help="your request trace: CSV, JSONL or parquet with "
                   "arrival_s, prompt_tokens, output_tokens")
    p.add_argument("--steps", type=Path, default=None, help="a recorded list of per-step token counts instead")
    # its own dest: the dispatcher fills a missing ``store`` with the default one, and here no --store means
    # predicted rows
    p.add_argument("--store", dest="measured_store", metavar="DIR", type=Path, default=None, help="measured rows from this sweep store (else predicted "
                   f"rows); {STORE_HELP}")
    p.add_argument("--device", default=None, help="with --store: the device_name of the rows to use")
    p.add_argument("--config", type=Path, default=None, help="a tuned config (an exported file or LabConfig JSON) "
                   "priced as one more policy, through its own gates; with --store its own tuned rows")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192, help="token budget per step "
                   "(vLLM's default on H100/H200 for its server: 8192)")
    p.add_argument("--max-num-seqs", type=positive_int, default=1024, help="requests in flight (default 1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled workload")
    p.add_argument("--validate", action="store_true", help="the seed's result, AIConfigurator's static figures and "
                   "where SP + AsyncTP pays (predicted rows; about a minute)")


def _traffic(args: argparse.Namespace):
    from sp_lab.resources import load_preset
    from sp_lab.serving.traces import read_steps, read_trace
    from sp_lab.serving.workloads import workload

    if args.steps is not None:
        return read_steps(args.steps)
    concurrency = args.concurrency if (args.concurrency or args.rate) else 64
    if args.trace is not None:
        return read_trace(args.trace, concurrency=args.concurrency)
    return workload(args.workload).traffic(args.requests, rate_per_s=args.rate, concurrency=concurrency,
                                           max_model_len=int(load_preset(args.model)["max_position_embeddings"]),
                                           seed=args.seed)


def run(args: argparse.Namespace) -> int:
    from sp_lab.serving.scheduler import SchedulerLimits
    from sp_lab.serving.step_costs import LatencyCurves, measured_setup, predicted_curves, shared_terms
    from sp_lab.serving.verdict import evaluate

    if args.validate:
        from sp_lab.serving.validation import validation_text

        text, passed = validation_text()
        print(text)
        return 0 if passed else 1
    if args.trace is not None and args.steps is not None:
        raise CliError("give --trace or --steps, not both")
    try:
        from sp_lab.serving.workloads import workload

        workload(args.workload)  # a mistyped name fails before any row is predicted
        config = None
        if args.config is not None:
            from sp_lab.config import load_tuned_config

            config, _ = load_tuned_config(args.config)
            if config.heuristic is not None and args.measured_store is None:
                raise CliError(f"{args.config} fuses per matmul by its own rule, but predicted 'tuned' rows follow the "
                               "rule the performance model implies: give measured rows of that config (--store)")
        limits = SchedulerLimits(args.max_num_batched_tokens, args.max_num_seqs)
        if args.measured_store is not None:
            rows, choice = measured_setup(args.measured_store, args.model, args.tp, dtype=args.dtype,
                                          device_name=args.device, config=config)
            curves = LatencyCurves.from_rows(rows, shared=shared_terms(args.model, args.tp, args.gpu))
            print(f"rows: measured, from {args.measured_store}\n{choice.message('cli')}")
        else:
            curves = predicted_curves(args.model, args.tp, args.gpu, dtype=args.dtype or "bfloat16",
                                      max_tokens=args.max_num_batched_tokens)
            print("rows: PREDICTED by sp_lab's performance model (no --store given)")
        verdict = evaluate(curves, _traffic(args), limits=limits, config=config)
    except ValueError as e:
        raise CliError(str(e)) from e
    print(verdict.text())
    judged = verdict.result(verdict.judged)
    print(f"\nserving speedup vs baseline: {judged.speedup:.2f}x ({verdict.source}; {judged.policy})")
    return 0
