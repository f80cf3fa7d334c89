"""The parser of ``python -m sp_lab`` and its entry point: one sub-command per module of this package.

A command module holds ``HELP`` (its line in ``--help``), ``add_arguments(parser)`` and ``run(args) -> int``. A new
command is a new module and one entry in :data:`COMMAND_MODULES`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from sp_lab.cli import export, predict, replay, report, run, sweep, traffic, tune
from sp_lab.cli.errors import CliError
from sp_lab.config import ConfigError

COMMAND_MODULES: dict[str, ModuleType] = {
    "run": run, "sweep": sweep, "tune": tune, "export": export, "report": report, "replay": replay,
    "predict": predict, "traffic": traffic,
}
# What each command runs; a test may swap one.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {name: m.run for name, m in COMMAND_MODULES.items()}


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``python -m sp_lab``, one sub-parser per command module."""
    parser = argparse.ArgumentParser(
        prog="python -m sp_lab",
        description="SP + AsyncTP under piecewise torch.compile: sweep latency, tune the policy, export the "
        "tuned config, report.",
        epilog="Multi-GPU: torchrun --nproc-per-node N -m sp_lab sweep --tp N ... (each rank runs in place).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMAND_MODULES.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.__doc__))
    return parser


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
