"""Where a measuring command runs: on spawned ranks from here, or in place on each rank under torchrun."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sp_lab.cli.errors import CliError

if TYPE_CHECKING:
    from sp_lab.config import LabConfig


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank under torchrun; ``value`` itself otherwise."""
    if not under_torchrun():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sweep(args: argparse.Namespace, *, store: Path, variants: Sequence[str], config: LabConfig,
          reports_dir: Path | None, progress: bool) -> Any:
    """Measure ``variants`` into ``store``: in place under torchrun, else on ``args.tp`` spawned ranks."""
    from sp_lab.bench.sweep import SweepArgumentError, launch_sweep, run_sweep

    kwargs = {"token_counts": args.tokens, "variants": list(variants), "config": config, "store_dir": str(store),
              "dtype": args.dtype, "num_layers": args.num_layers, "warmup": args.warmup, "repeats": args.repeats,
              "max_repeats": args.max_repeats, "ci_width": args.ci_width, "budget_s": args.budget,
              "cuda_graph": not args.no_cuda_graph, "reports_dir": str(reports_dir) if reports_dir else None}
    try:
        if under_torchrun():
            from sp_lab.distributed.launch import init_from_env

            init_from_env(args.backend, timeout=args.timeout)
            return run_sweep(args.model, tp_size=args.tp, progress=progress, **kwargs)
        return launch_sweep(args.model, world_size=args.tp, backend=args.backend, timeout=args.timeout,
                            progress=progress, **kwargs)
    except SweepArgumentError as e:  # refused before any rank started: nothing to resume
        raise CliError(str(e)) from None
