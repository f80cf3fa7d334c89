"""The provenance block every file under data/h200/ carries: device, driver, torch, CUDA, date, command."""

from __future__ import annotations

import datetime
import os
import shlex
import socket
import subprocess
import sys

import torch


def provenance(**extra) -> dict:
    """``{"device", "driver", "torch", "cuda", "date", "command", "hostname", ...extra}`` for this process."""
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30, check=False).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = "unknown"
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": os.environ.get("SP_LAB_BENCH_COMMAND") or " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "hostname": socket.gethostname(),
        "source": "measured",
        **extra,
    }
