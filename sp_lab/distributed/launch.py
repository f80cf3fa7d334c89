"""Run a function on N ranks with a process group initialised, from a notebook cell or under torchrun.

``launch(fn, *args, world_size=2)`` starts one fresh Python process per rank, initialises the default
process group in each (gloo on CPU, NCCL with one GPU per rank on CUDA), calls ``fn(*args, **kwargs)``
and returns every rank's result in rank order::

    def allreduce_rank(scale):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return scale * t.item()

    sp_lab.launch(allreduce_rank, 10.0, world_size=2)   # -> [10.0, 10.0]

How it is built, and why:

- Workers are forked from a warm server process that has imported torch, Dynamo and Inductor once for
  this caller (:mod:`sp_lab.distributed.forkserver`; ``SP_LAB_FORKSERVER=0``: fresh interpreters started
  with :class:`subprocess.Popen`). The caller itself is never forked: torch holds threads and CUDA state
  that do not survive a fork. Unlike ``multiprocessing``'s spawn, neither way re-imports the caller's
  ``__main__``, so a script without an ``if __name__ == "__main__"`` guard works.
- What a rank runs, however it was started, is :func:`sp_lab.distributed.worker.worker_main`: the modules
  that start ranks import it, never this launcher.
- ``fn`` and its arguments travel with cloudpickle, which pickles functions defined in a notebook (or any
  ``__main__``) by value. Workers get the caller's ``sys.path`` so functions of importable modules resolve.
  ``torch.ops`` and its ops travel by name, and custom ops defined in the notebook are re-created in every
  rank before the function is loaded (:mod:`sp_lab.distributed.job`).
- The rendezvous store (a :class:`torch.distributed.TCPStore` on 127.0.0.1, port chosen by the OS) lives
  in the caller, so no rank races for a free port and a dead rank 0 cannot take the store with it.
- No rank runs the function before every rank has formed the process group (torch's store-based barrier at the
  end of ``init_process_group``, switched on for every rank: ``RANK_ENV_DEFAULTS``): a rank that finished early
  would otherwise close connections a slower peer's gloo mesh was still setting up.
- A failure while the ranks form their process group (before the user's function runs: a gloo connection
  refused or timed out under heavy load) starts the ranks again once, with a new store, within the same timeout.
- Each rank reports ``("ok", result)`` or ``("error", ...)`` over a pipe of its own. EOF on that pipe
  without a report means the rank died (SIGKILL, segfault): the caller reads its exit status.
- Each worker leads its own session (process group), so clean-up kills whole process trees
  (SIGTERM, then SIGKILL). A "lifeline" pipe whose write end only the caller holds makes workers kill
  themselves if the caller dies, so even a SIGKILLed notebook kernel leaves no orphans.
- Worker stdout/stderr are forwarded to the caller's, prefixed ``[rank N]``, so prints appear in the
  notebook cell rather than in the kernel's log. On timeout, the stuck ranks' Python stacks are dumped
  (faulthandler, SIGUSR1) and quoted in the error.

Under torchrun the same worker logic runs through :func:`init_from_env` / :func:`run_under_torchrun`,
or from the command line::

    torchrun --nproc-per-node 2 -m sp_lab.distributed.launch mypackage.module:function
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait as wait_for_connections
from typing import Any

import cloudpickle
import torch.distributed as dist

from sp_lab.distributed.errors import LaunchError, LaunchTimeout, RankError, describe_exit
from sp_lab.distributed.job import Job, check_before_launch, serialise_job
from sp_lab.distributed.process_group import (
    RankInfo,
    init_from_env,
    resolve_backend,
    run_under_torchrun,
)
from sp_lab.distributed.rank_processes import Worker, dump_stacks, kill_trees, start_worker

__all__ = [
    "LaunchError",
    "LaunchTimeout",
    "RankError",
    "RankInfo",
    "init_from_env",
    "launch",
    "resolve_backend",
    "run_under_torchrun",
]

# After the first failure, how long to keep listening for reports of other ranks: a second rank
# failing on its own (not because of the first) is worth seeing, and this is short enough to feel instant.
_FAILURE_GRACE_S = 0.5
# After every rank has reported, how long ranks get to tear their process group down and exit.
_EXIT_GRACE_S = 5.0
# Longest single wait of the caller's loop: short, so Ctrl-C in a notebook is handled promptly.
_POLL_S = 0.25
# Starts of the ranks when forming the process group fails: the user's function has not run yet. The early-exit
# race behind "Connection closed by peer" is prevented by the barrier in RANK_ENV_DEFAULTS (its comment says how);
# the second start remains for what load can still do to a rendezvous (a connection refused or timed out).
_RENDEZVOUS_ATTEMPTS = 2


def _check_launch_args(fn: Any, world_size: Any, timeout: Any) -> None:
    if not callable(fn):
        raise TypeError(f"launch() needs a callable to run on every rank, got {type(fn).__name__} {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (number of ranks), got {world_size!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _check_fn_takes(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
    """``fn`` can be called with ``args`` and ``kwargs``: refused here, once, rather than from every rank."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable without one: the ranks find out
        return
    signature = signature.replace(return_annotation=inspect.Signature.empty)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(f"launch(): {name}{signature} cannot take the arguments given ({error})") from None


def _receive(worker: Worker) -> None:
    """Read the rank's report, or record that it died without one."""
    try:
        data = worker.results.recv_bytes()
    except (EOFError, OSError):
        try:
            worker.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
        worker.stderr.join(timeout=1.0)  # its last lines (a faulthandler stack) before the caller quotes them
        worker.report = ("died", worker.process.poll())
        return
    try:
        worker.report = cloudpickle.loads(data)
    except Exception as error:  # noqa: BLE001 - any unpickling failure becomes this rank's error
        worker.report = (
            "error",
            type(error).__name__,
            f"the result of rank {worker.rank} could not be unpickled in the caller: {error}",
            traceback.format_exc(),
            "run",
            time.time(),
        )


def _failure_message(worker: Worker) -> tuple[str, str | None, int | None]:
    """(message, traceback, exitcode) for a failed rank."""
    kind = worker.report[0]
    if kind == "died":
        exitcode = worker.report[1]
        tail = worker.stderr_tail()
        message = f"rank {worker.rank} {describe_exit(exitcode)} before reporting a result"
        if tail.strip():
            message += f"; last lines of its stderr:\n{tail.rstrip()}"
        return message, None, exitcode
    _, exc_type, text, tb, _, _ = worker.report
    return (
        f"rank {worker.rank} raised {exc_type}: {text}\n\nTraceback from rank {worker.rank}:\n{tb.rstrip()}",
        tb,
        None,
    )


def _one_line(worker: Worker) -> str:
    if worker.report[0] == "died":
        return f"rank {worker.rank} {describe_exit(worker.report[1])}"
    first_line = (str(worker.report[2]).splitlines() or [""])[0]  # a bare ``assert`` has no text
    return f"rank {worker.rank} raised {worker.report[1]}: {first_line[:200]}"



def launch(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    backend: str = "auto",
    timeout: float = 300.0,
    **kwargs: Any,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks with the default process group initialised.

    Args:
        fn: any picklable-by-cloudpickle callable: a module function, a function or lambda defined in a
            notebook, a closure. Inside it, ``torch.distributed`` is initialised (rank, world size, the
            default group) and, with NCCL, ``torch.cuda.current_device()`` is this rank's GPU.
        *args, **kwargs: passed to ``fn`` on every rank (sent with cloudpickle).
        world_size: number of ranks (processes).
        backend: "auto" (NCCL with one GPU per rank when there are enough GPUs, else gloo on the CPU),
            "gloo", "nccl", or another backend built into this torch.
        timeout: seconds for the whole run, start-up included. Past it the ranks still running are
            killed and :class:`LaunchTimeout` is raised.

    Returns:
        ``[result_of_rank_0, result_of_rank_1, ...]``. Results must be picklable; tensors come back on
        the CPU.

    Raises:
        ValueError / TypeError: bad ``world_size``, ``timeout``, ``backend``, arguments ``fn`` cannot take or an
            unpicklable argument, before any process starts.
        RankError: a rank raised (its traceback is in the message) or died (its exit code or signal).
        LaunchTimeout: ranks still running (their stacks are in the message), or not yet started, at the deadline.

    Worker processes are always cleaned up: on success, on error, on timeout and on Ctrl-C.
    """
    _check_launch_args(fn, world_size, timeout)
    check_before_launch(args, kwargs, world_size)
    _check_fn_takes(fn, args, kwargs)
    backend = resolve_backend(backend, world_size)
    deadline = time.monotonic() + timeout
    for _ in range(_RENDEZVOUS_ATTEMPTS - 1):
        try:
            return _run_ranks(fn, args, kwargs, world_size, backend, timeout, deadline)
        except RankError as error:
            if not error.during_rendezvous or time.monotonic() >= deadline:
                raise
            first_line = str(error).splitlines()[0][:300]
            print(f"sp_lab.launch: the ranks could not form their process group ({first_line}); "
                  "starting them again", file=sys.stderr, flush=True)
    return _run_ranks(fn, args, kwargs, world_size, backend, timeout, deadline)


def _run_ranks(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], world_size: int, backend: str,
               timeout: float, deadline: float) -> list:
    """One start of the ranks: a fresh store, ``world_size`` ranks, their results (or the error)."""
    # The caller hosts the rendezvous store: port 0 lets the OS pick a free one, with no race.
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )
    workdir: str | None = None
    lifeline_read = lifeline_write = -1
    workers: list[Worker] = []
    try:  # from here on the store is dropped however this ends (a kept traceback would keep it listening)
        payload = serialise_job(Job(fn, args, kwargs, backend, float(timeout), store.port))
        workdir = tempfile.mkdtemp(prefix="sp_lab_launch_")
        lifeline_read, lifeline_write = os.pipe()
        job_path = os.path.join(workdir, "job.pkl")
        with open(job_path, "wb") as file:
            file.write(payload)
        for rank in range(world_size):
            try:
                workers.append(start_worker(rank, world_size, backend, store.port, job_path, lifeline_read,
                                            timeout=max(deadline - time.monotonic(), 0.0)))
            except TimeoutError as error:
                raise LaunchTimeout(
                    f"sp_lab.launch timed out after {timeout:g} s before rank {rank} of {world_size} had started "
                    f"({error}); the first launch in a process waits for its rank fork server to import torch: "
                    "pass a larger timeout=", ranks=list(range(rank, world_size)), timeout=timeout, stacks={},
                ) from None
        os.close(lifeline_read)
        lifeline_read = -1
        _wait_for_reports(workers, deadline, timeout)
        # Every rank reported success; give them a moment to tear the group down and exit cleanly.
        exit_by = min(deadline, time.monotonic() + _EXIT_GRACE_S)
        for worker in workers:
            try:
                worker.process.wait(timeout=max(0.0, exit_by - time.monotonic()))
            except subprocess.TimeoutExpired:
                break  # the finally block kills the stragglers; their results are already in
        return [worker.report[1] for worker in workers]
    finally:
        try:
            kill_trees(workers)
        finally:
            # Even if clean-up itself is interrupted (a second Ctrl-C), closing the lifeline makes any
            # surviving worker kill its own process group.
            for fd in (lifeline_read, lifeline_write):
                if fd >= 0:
                    os.close(fd)
            for worker in workers:
                worker.results.close()
                worker.stdout.join(timeout=2.0)
                worker.stderr.join(timeout=2.0)
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
            del store


def _root_cause_first(failures: list[Worker]) -> list[Worker]:
    """Failed ranks, the one that failed first leading.

    Reports that arrive within one poll come in no particular order, and a rank's failure makes its peers fail
    in their next collective ("Connection closed by peer"): order by when each rank raised (its own clock, on
    this machine), a rank that died first of all (a peer's failure makes a rank raise, never die)."""
    return sorted(failures, key=lambda w: float("-inf") if w.report[0] == "died" else w.report[5])


def _wait_for_reports(workers: list[Worker], deadline: float, timeout: float) -> None:
    """Block until every rank reported success; raise on the first failure or at the deadline."""
    pending = {worker.results: worker for worker in workers}
    failures: list[Worker] = []
    stop_listening_at = deadline
    while pending:
        now = time.monotonic()
        if now >= stop_listening_at:
            break
        for conn in wait_for_connections(list(pending), timeout=min(_POLL_S, stop_listening_at - now)):
            worker = pending.pop(conn)
            _receive(worker)
            if worker.report[0] != "ok":
                failures.append(worker)
                stop_listening_at = min(stop_listening_at, time.monotonic() + _FAILURE_GRACE_S)

    if failures:
        failures = _root_cause_first(failures)
        first = failures[0]
        message, tb, exitcode = _failure_message(first)
        others = [_one_line(w) for w in failures[1:]]
        if others:
            message += "\n\nAlso failed (often a consequence of the first failure):\n  " + "\n  ".join(others)
        during_rendezvous = all(w.report[0] == "error" and w.report[4] == "rendezvous" for w in failures)
        raise RankError(message, rank=first.rank, traceback=tb, exitcode=exitcode, other_failures=others,
                        during_rendezvous=during_rendezvous)
    if pending:
        stuck = sorted(pending.values(), key=lambda w: w.rank)
        stacks = dump_stacks(stuck)
        ranks = [w.rank for w in stuck]
        finished = [w.rank for w in workers if w.rank not in ranks]
        message = (
            f"sp_lab.launch timed out after {timeout:g} s: rank(s) {', '.join(map(str, ranks))} of "
            f"{len(workers)} still running"
            + (f" (rank(s) {', '.join(map(str, finished))} finished)" if finished else "")
            + ". They have been killed. A rank stuck in a collective usually means another rank skipped "
            "or reordered it; if the work is just slow, pass a larger timeout=."
        )
        for rank in ranks:
            if stacks.get(rank, "").strip():
                message += f"\n\nStack of rank {rank} when it was stopped:\n{stacks[rank].rstrip()}"
        raise LaunchTimeout(message, ranks=ranks, timeout=timeout, stacks=stacks)


# ----------------------------------------------------------------------------------------------------
# Command line: python -m sp_lab.distributed.launch module:function [args...]


def _load_function(spec: str) -> Callable[..., Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(f"expected MODULE:FUNCTION (e.g. mypackage.jobs:allreduce), got {spec!r}")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise SystemExit(f"{spec} is a {type(target).__name__}, not a function")
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sp_lab.distributed.launch MODULE:FUNCTION [ARG ...]``.

    Under torchrun (RANK set) every process runs its own rank via :func:`run_under_torchrun`;
    otherwise :func:`launch` starts ``--world-size`` ranks here. String arguments are passed as given.
    Each rank's result is printed as ``rank N: repr(result)``.
    """
    parser = argparse.ArgumentParser(prog="python -m sp_lab.distributed.launch", description=main.__doc__)
    parser.add_argument("function", help="MODULE:FUNCTION to run on every rank")
    parser.add_argument("args", nargs="*", help="string arguments passed to the function")
    parser.add_argument("--backend", default="auto", help="auto (default), gloo, nccl, ...")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to start when not under torchrun")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds (launch mode)")
    options = parser.parse_args(argv)
    fn = _load_function(options.function)
    if "RANK" in os.environ:
        result = run_under_torchrun(fn, *options.args, backend=options.backend)
        # One write per line: the ranks share torchrun's stdout, and print() writes the newline apart.
        sys.stdout.write(f"rank {os.environ['RANK']}: {result!r}\n")
        sys.stdout.flush()
        return 0
    results = launch(
        fn, *options.args, world_size=options.world_size, backend=options.backend, timeout=options.timeout
    )
    for rank, result in enumerate(results):
        print(f"rank {rank}: {result!r}")
    return 0


if __name__ == "__main__":
    # Run the copy importable as sp_lab.distributed.launch, so the classes pickled for the workers are
    # the module's own and not duplicates living in __main__.
    sys.exit(importlib.import_module("sp_lab.distributed.launch").main())
