"""What a benchmark's figures were measured on: one record for every script under ``benchmarks/``.

A figure means little without its machine, so each script prints this beside its numbers. The CPU's name is the
one sp_lab's sweep rows carry (:func:`sp_lab.bench.sweep.cpu_name`), so a benchmark and a sweep from one machine
name it alike.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from sp_lab.bench.sweep import cpu_name

__all__ = ["describe", "machine"]


def machine() -> dict[str, Any]:
    """The CPU, the cores this process may use (of how many), torch's threads, the GPUs, python, torch, the OS.

    ``cores`` is the process's CPU affinity where the OS has one: a benchmark that pins itself (as
    ``bench_explorer.py`` does) reports what it ran on, not what the machine has."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_name(),
        "cores": usable,
        "cores_total": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpus": gpus,
        "gpu_name": torch.cuda.get_device_name(0) if gpus else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def describe(info: dict[str, Any]) -> str:
    """One line for a table's header: ``2 of 2 cores (AMD EPYC), no GPU; python 3.11.7, torch 2.13.0+cpu``."""
    gpus = f"{info['gpus']} x {info['gpu_name']}" if info["gpus"] else "no GPU"
    return (f"{info['cores']} of {info['cores_total']} cores ({info['cpu']}), {gpus}; python {info['python']}, "
            f"torch {info['torch']}")
