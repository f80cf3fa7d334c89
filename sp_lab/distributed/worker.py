"""The rank's side of :func:`sp_lab.launch`: what every rank process runs, however it was started.

A rank is either forked by the warm server (:mod:`sp_lab.distributed.forkserver`) or started as a fresh
interpreter (:mod:`sp_lab.distributed.rank_processes`); both end in :func:`worker_main`, which loads the pickled
job, forms the process group, runs the function and sends back its result or its error. It lives apart from the
caller's side (:mod:`sp_lab.distributed.launch`) so that the modules starting ranks import it without importing
the launcher that imports them.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from sp_lab.distributed.job import Job, recreate_custom_ops
from sp_lab.distributed.process_group import cpu_threads_per_rank, init_process_group

__all__ = ["worker_main"]


def _watch_lifeline(fd: int, workdir: str) -> None:
    """Kill this worker's whole process group as soon as the caller is gone (its end of the pipe closes).

    A caller killed outright (a notebook kernel's SIGKILL) removes nothing: its ranks remove the launch's
    ``workdir`` (the pickled job) on their way out instead. A caller that lived does it too; both ignore a
    directory already gone."""

    def watch() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        shutil.rmtree(workdir, ignore_errors=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="sp_lab-lifeline", daemon=True).start()


def _to_cpu(value: Any) -> Any:
    """Move tensors in a (nested) result to the CPU so the caller never needs this rank's GPU."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), value)


def _send_error(results: Connection, error: BaseException, context: str = "", stage: str = "run") -> None:
    tb = traceback.format_exc()
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the traceback
        text = "<exception text unavailable>"
    results.send_bytes(cloudpickle.dumps(("error", type(error).__name__, context + text, tb, stage, time.time())))


def _exit_now(code: int) -> None:
    """Leave without running atexit hooks or joining threads the user's function may have left."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def worker_main(argv: Sequence[str]) -> None:
    """Entry point of a rank started by :func:`sp_lab.launch`: ``argv`` is the pickled job's path, the result
    pipe's and the lifeline pipe's descriptors. Never returns (the process exits)."""
    job_path, result_fd, lifeline_fd = argv[0], int(argv[1]), int(argv[2])
    _watch_lifeline(lifeline_fd, os.path.dirname(job_path))
    faulthandler.enable()  # a segfault leaves a Python stack in the stderr tail the caller quotes
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the caller's "where are you stuck?"
    results = Connection(result_fd, readable=False)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    try:
        with open(job_path, "rb") as file:
            recreate_custom_ops(cloudpickle.load(file))  # first: loading the job may look the ops up
            job: Job = cloudpickle.load(file)
    except BaseException as error:  # noqa: BLE001 - reported to the caller, which raises it
        _send_error(results, error, context="could not load the function and its arguments: ")
        _exit_now(1)

    try:
        if job.backend != "nccl":
            torch.set_num_threads(cpu_threads_per_rank(world_size))
        store = dist.TCPStore(
            "127.0.0.1",
            job.store_port,
            world_size,
            False,
            timeout=datetime.timedelta(seconds=job.timeout_s),
        )
        init_process_group(
            job.backend,
            rank=rank,
            world_size=world_size,
            local_rank=int(os.environ["LOCAL_RANK"]),
            timeout_s=job.timeout_s,
            store=store,
        )
    except BaseException as error:  # noqa: BLE001 - nothing of the user's ran: the caller may start us again
        _send_error(results, error, stage="rendezvous")
        _exit_now(1)

    try:
        result = job.fn(*job.args, **job.kwargs)
    except BaseException as error:  # noqa: BLE001 - SystemExit / KeyboardInterrupt in fn are failures too
        _send_error(results, error)
        _exit_now(1)  # no group teardown: peers may be stuck in a collective; the caller kills them

    try:
        data = cloudpickle.dumps(("ok", _to_cpu(result)))
    except BaseException as error:  # noqa: BLE001 - reported to the caller, which raises it
        _send_error(
            results,
            error,
            context=f"the result of rank {rank} ({type(result).__name__}) cannot be sent back: results "
            "must be picklable (numbers, strings, tensors, dicts/lists of them, dataclasses); ",
        )
        _exit_now(1)
    results.send_bytes(data)
    results.close()
    try:
        dist.destroy_process_group()
    finally:
        _exit_now(0)
