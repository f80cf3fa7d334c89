"""Argument types and the option groups several commands share.

Each type names the bad value and what would work (argparse prints it as a usage error, exit status 2). Nothing
heavy is imported here: ``python -m sp_lab --help`` must answer at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sp_lab.config import BoundaryStrategy
from sp_lab.programs import VARIANTS
from sp_lab.vocabulary import DEFAULT_OUT, DEFAULT_STORE, NEVER, SOURCES

DEFAULT_TOKENS = "1,2,4,8,16,32,64,128,256,512"
STORE_HELP = (f"sweep store (default {DEFAULT_STORE} in the project: the nearest directory up from here with a "
              "pyproject.toml or .git; SP_LAB_OUT names another output folder)")
OUT_HELP = f"output directory (default {DEFAULT_OUT}/ in the project; SP_LAB_OUT names another)"


def token_list(text: str) -> list[int]:
    """``--tokens 1,16,128``: positive token counts."""
    try:
        counts = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts like 1,16,128, got {text!r}")
    if not counts or any(t < 1 for t in counts):
        raise argparse.ArgumentTypeError(f"token counts must be positive integers, got {text!r}")
    return counts


def variant_list(text: str) -> list[str]:
    """``--variants sp,sp+async_tp``: names from the variants' table."""
    variants = [v for v in text.replace(" ", "").split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise argparse.ArgumentTypeError(f"unknown variants {bad or text!r}; choose from {', '.join(VARIANTS)}")
    return variants


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def threshold(text: str) -> int | None:
    """``--threshold 64`` or ``never`` (SP and AsyncTP off)."""
    return None if text == NEVER else positive_int(text)


def vllm_release(text: str) -> str:
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


def add_measure_args(p: argparse.ArgumentParser, *, budget: float | None = None) -> None:
    """What a sweep measures and how long it may time (``run``, ``sweep``)."""
    p.add_argument("--model", default="toy", help="toy, a preset (llama-3-8b, ...) or a HF checkpoint dir")
    p.add_argument("--tp", type=positive_int, default=2, help="tensor-parallel ranks (default 2)")
    p.add_argument("--tokens", type=token_list, default=token_list(DEFAULT_TOKENS),
                   help=f"token counts, comma-separated (default {DEFAULT_TOKENS})")
    p.add_argument("--num-layers", type=positive_int, default=None, help="keep only this many layers")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    p.add_argument("--boundary", default=None, choices=[b.value for b in BoundaryStrategy],
                   help=f"boundary strategy: {BoundaryStrategy.names()}")
    p.add_argument("--config", type=Path, default=None, help="base LabConfig JSON (default: LabConfig())")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per point (default 3)")
    p.add_argument("--repeats", type=positive_int, default=10, help="least timed calls per point (default 10)")
    p.add_argument("--max-repeats", type=positive_int, default=None, help="most timed calls per point (10x)")
    p.add_argument("--ci-width", type=float, default=0.05,
                   help="stop once each median's 95%% interval is this fraction of it (default 0.05)")
    p.add_argument("--budget", type=float, default=budget,
                   help=f"seconds of timing per sweep, shared by its token counts (default {budget or 'none'})")
    p.add_argument("--no-cuda-graph", action="store_true", help="time eager calls on CUDA")
    p.add_argument("--backend", default="auto", help="auto (default), gloo, nccl")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole sweep (default 3600)")


def setup_query(text: str) -> dict[str, str]:
    """``--setup``: ``FIELD=VALUE[,FIELD=VALUE...]`` (:func:`sp_lab.bench.setups.parse_query`), checked while
    parsing."""
    from sp_lab.bench.setups import parse_query

    try:
        return parse_query(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_filter_args(p: argparse.ArgumentParser) -> None:
    """Which rows of a store a command reads (``tune``, ``export``, ``report``): one setup, the one the flags ask
    for (the newest of those that match), else the newest (:func:`sp_lab.bench.setups.select_setup`)."""
    p.add_argument("--store", type=Path, default=None, help=STORE_HELP)
    p.add_argument("--setup", type=setup_query, default=None, metavar="FIELD=VALUE,...",
                   help="the setup to use when the store holds several, e.g. dtype=bfloat16,num_layers=1 (fields: "
                   "model, hidden_size, num_layers, tp, dtype, device_name, backend, boundary, torch_version, "
                   "settings; default: the newest; the command lists the others)")
    p.add_argument("--model", default=None, help="only rows of this model (a --setup field)")
    p.add_argument("--tp", type=positive_int, default=None, help="only rows of this tp size (a --setup field)")
    p.add_argument("--device-name", default=None, help="only rows measured on this device (a --setup field)")
    p.add_argument("--dtype", default=None, help="only rows of this dtype (a --setup field)")
    p.add_argument("--boundary", default=None, help="only rows of this boundary strategy (a --setup field)")
    p.add_argument("--source", choices=SOURCES, default=None,
                   help="rows to tune on (default: measured, else replayed; others only when named)")
    p.add_argument("--skip-corrupt", action="store_true", help="quarantine unreadable part files and go on")


def add_vllm_arg(p: argparse.ArgumentParser) -> None:
    """``--vllm-release``: the release an exported file's vllm section is written for."""
    from sp_lab.vllm_releases import DEFAULT_RELEASE

    p.add_argument("--vllm-release", type=vllm_release, default=None,
                   help="vLLM release the file's vllm section is written for, e.g. 0.18 or 0.31.0 (default: the "
                   f"installed vLLM, else the newest known, {DEFAULT_RELEASE})")
