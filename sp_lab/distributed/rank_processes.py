"""The caller's handle on the rank processes :func:`sp_lab.launch` starts: start, forward output, stop.

- Workers are children of a warm fork server that has torch, Dynamo and Inductor imported
  (:mod:`sp_lab.distributed.forkserver`), or fresh interpreters started with :class:`subprocess.Popen`
  where it is off. The caller itself is never forked: its threads and CUDA state would not survive it.
  Each worker leads its own session so clean-up kills whole process trees (SIGTERM, then SIGKILL).
- Worker stdout/stderr are forwarded to the caller's, prefixed ``[rank N]``, so prints appear in the
  notebook cell; the last lines are kept for error messages. A rank's stderr line goes to the caller's
  stderr only when it reads as a problem (a traceback, an error, a warning); progress bars and log lines
  that libraries write to stderr (Hugging Face's "Loading weights" bar) go to stdout, where a notebook
  does not paint them red. A bar redrawn with carriage returns is forwarded at its last state.
- On timeout, the stuck ranks' Python stacks are dumped (faulthandler, SIGUSR1) and quoted in the error.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import TextIO

from sp_lab.distributed import forkserver
from sp_lab.distributed.process_group import RANK_ENV_DEFAULTS, cpu_threads_per_rank

# A rank: a fresh interpreter (Popen) or a child of the warm fork server (forkserver.ForkedRank).
RankProcess = subprocess.Popen | forkserver.ForkedRank

__all__ = ["Worker", "dump_stacks", "kill_trees", "start_worker"]

# Between SIGTERM and SIGKILL during clean-up.
_TERMINATE_GRACE_S = 3.0
# How much of a rank's stderr to keep for error messages.
_STDERR_TAIL_LINES = 400


# What makes a stderr line a problem worth red: Python's traceback and exception lines, warnings, errors.
_PROBLEM = re.compile(r"Traceback|Error|Exception|Warning|warn|error|FAIL|Fatal|Segmentation|Aborted")


class _OutputPump:
    """Forwards one stream of a worker to the caller's, line by line with a ``[rank N]`` prefix.

    Keeps the last lines so error messages can quote what a dying rank printed.
    """

    def __init__(self, source, rank: int, target: Callable[[], TextIO], keep: int,
                 calm: Callable[[], TextIO] | None = None):
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.count = 0  # lines seen so far, to find what arrived after a given moment
        self._source = source
        self._prefix = f"[rank {rank}] "
        self._target = target
        self._calm = calm  # where lines that are not problems go (None: everything to target)
        self._in_problem = False  # inside a traceback or warning: its indented lines stay with it
        self._thread = threading.Thread(target=self._pump, name=f"sp_lab-rank{rank}-output", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for raw in iter(self._source.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            self.lines.append(line)
            self.count += 1
            # A closed or odd caller stream must not kill the pump: the worker would block on a full pipe.
            with contextlib.suppress(Exception):
                # Resolved per line: in Jupyter, sys.stdout is swapped per cell.
                shown = line.rstrip("\n").split("\r")[-1] + "\n"  # a bar's last redraw
                continues = self._in_problem and (line[:1] in (" ", "\t") or not line.strip())
                self._in_problem = bool(_PROBLEM.search(line)) or continues
                calm = self._calm is not None and not self._in_problem
                stream = self._calm() if calm else self._target()
                stream.write(self._prefix + shown)
                stream.flush()
        self._source.close()

    def lines_since(self, count: int) -> str:
        new = min(self.count - count, len(self.lines))
        return "".join(list(self.lines)[len(self.lines) - new :]) if new > 0 else ""

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


@dataclasses.dataclass
class Worker:
    """The caller's handle on one rank."""

    rank: int
    process: RankProcess
    results: Connection
    """Read end of the rank's result pipe."""
    stdout: _OutputPump
    stderr: _OutputPump
    report: tuple | None = None
    """("ok", result), ("error", exc_type, message, traceback, stage, raised_at) or ("died", exitcode), once
    received; ``stage`` is "rendezvous" when the rank raised while forming the process group, else "run";
    ``raised_at`` is the rank's ``time.time()`` when it caught the error."""

    def stderr_tail(self, lines: int = 20) -> str:
        tail = list(self.stderr.lines)[-lines:]
        return "".join(tail)



# Started with -c rather than -m so the caller's sys.path (a notebook's sys.path.insert included) is in
# place before sp_lab itself is imported; the same trick multiprocessing's spawn uses.
_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from sp_lab.distributed.worker import worker_main; worker_main(sys.argv[2:])"
)


def _worker_env(rank: int, world_size: int, backend: str, store_port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
        PYTHONUNBUFFERED="1",  # prints reach the caller as they happen
    )
    for key, value in RANK_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    if backend != "nccl":
        env["OMP_NUM_THREADS"] = str(cpu_threads_per_rank(world_size))
    # TORCHINDUCTOR_CACHE_DIR and everything else the caller set is inherited as is, so ranks share
    # the caller's compile cache.
    return env


def start_worker(
    rank: int, world_size: int, backend: str, store_port: int, job_path: str, lifeline_fd: int, timeout: float
) -> Worker:
    """Start one rank. ``timeout``: seconds a forked rank's start may take (its fork server may still be importing
    torch), past which :class:`TimeoutError`; a fresh interpreter (``SP_LAB_FORKSERVER=0``, a CUDA machine) starts
    at once and imports on the launch's own clock."""
    read_fd, write_fd = os.pipe()
    env = _worker_env(rank, world_size, backend, store_port)
    try:
        if forkserver.enabled():
            process: RankProcess = forkserver.start_rank([job_path], env, write_fd, lifeline_fd, timeout)
        else:
            process = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path), job_path, str(write_fd), str(lifeline_fd)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(write_fd, lifeline_fd),
                start_new_session=True,  # own process group: clean-up kills the whole tree, Ctrl-C does not
            )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)  # only the worker may hold it, or EOF would never come
    return Worker(
        rank=rank,
        process=process,
        results=Connection(read_fd, writable=False),
        stdout=_OutputPump(process.stdout, rank, lambda: sys.stdout, keep=50),
        stderr=_OutputPump(process.stderr, rank, lambda: sys.stderr, keep=_STDERR_TAIL_LINES,
                           calm=lambda: sys.stdout),
    )


def dump_stacks(workers: Sequence[Worker]) -> dict[int, str]:
    """Ask stuck ranks for their Python stacks (faulthandler on SIGUSR1) and collect what arrives."""
    if not hasattr(signal, "SIGUSR1"):
        return {}
    before = {}
    for worker in workers:
        before[worker.rank] = worker.stderr.count
        try:
            worker.process.send_signal(signal.SIGUSR1)
        except (ProcessLookupError, OSError):
            pass
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(w.stderr.count == before[w.rank] for w in workers):
        time.sleep(0.05)
    time.sleep(0.1)  # the dump is several lines; let the rest of it arrive
    return {w.rank: w.stderr.lines_since(before[w.rank]) for w in workers}


def kill_trees(workers: Sequence[Worker]) -> None:
    """SIGTERM every worker's process group, wait a little, then SIGKILL what is left."""

    def signal_group(worker: Worker, sig: int) -> None:
        try:
            os.killpg(worker.process.pid, sig)  # pid == pgid: each worker leads its own session
        except (ProcessLookupError, PermissionError):
            pass

    alive = [w for w in workers if w.process.poll() is None]
    for worker in alive:
        signal_group(worker, signal.SIGTERM)
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for worker in alive:
        try:
            worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    # Also for workers that exited by themselves: children they left in their group die here.
    for worker in workers:
        signal_group(worker, signal.SIGKILL)
    for worker in workers:
        try:
            worker.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # unkillable (D state); nothing more to do from here
            pass

