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

- Workers are fresh interpreters started with :class:`subprocess.Popen` (never ``fork``: torch holds
  threads and CUDA state that do not survive a fork). Unlike ``multiprocessing``'s spawn they never
  re-import the caller's ``__main__``, so a script without an ``if __name__ == "__main__"`` guard works.
- ``fn`` and its arguments travel with cloudpickle, which pickles functions defined in a notebook (or any
  ``__main__``) by value. Workers get the caller's ``sys.path`` so functions of importable modules resolve.
- The rendezvous store (a :class:`torch.distributed.TCPStore` on 127.0.0.1, port chosen by the OS) lives
  in the caller, so no rank races for a free port and a dead rank 0 cannot take the store with it.
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
import collections
import contextlib
import dataclasses
import datetime
import faulthandler
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_connections
from typing import Any, TextIO

import cloudpickle
import torch
import torch.distributed as dist

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

# Environment every rank gets before the process group exists. NVLink multicast (NVLS) is kept off:
# it needs fabric-manager support that lent and shared machines often lack, and symmetric memory
# falls back to it silently. setdefault, so a user who knows better can still switch it on.
_RANK_ENV_DEFAULTS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# Backends a rank of launch() cannot use, and what to do instead.
_UNLAUNCHABLE = {
    "fake": "the fake backend runs in one process; use sp_lab.distributed.collectives.fake_process_group",
    "undefined": "'undefined' is a placeholder, not a backend",
}

# After the first failure, how long to keep listening for reports of other ranks: a second rank
# failing on its own (not because of the first) is worth seeing, and this is short enough to feel instant.
_FAILURE_GRACE_S = 0.5
# After every rank has reported, how long ranks get to tear their process group down and exit.
_EXIT_GRACE_S = 5.0
# Between SIGTERM and SIGKILL during clean-up.
_TERMINATE_GRACE_S = 3.0
# Longest single wait of the caller's loop: short, so Ctrl-C in a notebook is handled promptly.
_POLL_S = 0.25
# How much of a rank's stderr to keep for error messages.
_STDERR_TAIL_LINES = 400


# ----------------------------------------------------------------------------------------------------
# Errors


class LaunchError(RuntimeError):
    """Base class of the errors :func:`launch` raises once workers have started."""


class RankError(LaunchError):
    """A rank raised, returned something that cannot be sent back, or died without reporting.

    Attributes:
        rank: the failing rank (the first to fail when several did).
        traceback: the rank's formatted Python traceback, or None when the process died without one
            (SIGKILL, segfault, ``os._exit``).
        exitcode: the process's exit status when known: negative for "killed by signal -exitcode".
        other_failures: one line for each other rank that failed too, usually as a consequence.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        traceback: str | None = None,
        exitcode: int | None = None,
        other_failures: Sequence[str] = (),
    ):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.exitcode = exitcode
        self.other_failures = tuple(other_failures)

    @property
    def signal(self) -> signal.Signals | None:
        """The signal that killed the rank, if one did."""
        return _signal_of(self.exitcode)

    def __reduce__(self):
        return _rebuild_error, (type(self), str(self), self.__dict__)


class LaunchTimeout(LaunchError, TimeoutError):
    """The deadline passed while some ranks were still running (they have been killed).

    Attributes:
        ranks: the ranks that were still running.
        timeout: the ``timeout=`` given to :func:`launch`, in seconds.
        stacks: rank -> the Python stack dump taken just before the kill ("" if none arrived).
    """

    def __init__(
        self,
        message: str,
        *,
        ranks: Sequence[int] = (),
        timeout: float | None = None,
        stacks: dict[int, str] | None = None,
    ):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.timeout = timeout
        self.stacks = dict(stacks or {})

    def __reduce__(self):
        return _rebuild_error, (type(self), str(self), self.__dict__)


def _rebuild_error(cls: type[LaunchError], message: str, state: dict) -> LaunchError:
    error = cls(message)
    error.__dict__.update(state)
    return error


def _signal_of(exitcode: int | None) -> signal.Signals | None:
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode)
    except ValueError:
        return None


def _describe_exit(exitcode: int | None) -> str:
    sig = _signal_of(exitcode)
    if sig is not None:
        hint = " (often the kernel's out-of-memory killer)" if sig == signal.SIGKILL else ""
        return f"was killed by signal {sig.name}{hint} (exit code {exitcode})"
    if exitcode is None:
        return "closed its result pipe but did not exit"
    return f"exited with code {exitcode}"


# ----------------------------------------------------------------------------------------------------
# Backend choice and process-group initialisation (shared by launch() workers and torchrun)


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job, as seen after the process group is initialised."""

    rank: int
    """Global rank of this process, 0..world_size-1."""
    world_size: int
    """Number of ranks in the default group."""
    local_rank: int
    """Rank among the processes of this machine; selects the GPU with NCCL."""
    backend: str
    """The process group's backend: "gloo", "nccl", ..."""
    device: torch.device
    """The device this rank should compute on: cuda:local_rank with NCCL, cpu otherwise."""


def _known_backends() -> list[str]:
    return [b for b in dist.Backend.backend_list if b not in _UNLAUNCHABLE]


def resolve_backend(backend: str, world_size: int) -> str:
    """Turn ``backend`` ("auto", "gloo", "nccl", ...) into one that can run ``world_size`` ranks here.

    "auto" picks NCCL when CUDA and NCCL are present and there is one GPU per rank, else gloo (with a
    warning when some GPUs exist but too few). Raises ValueError naming the bad value and what would
    work: a backend unknown to this torch, one not built into it, or NCCL with more ranks than GPUs.
    ``world_size`` counts the ranks of *this machine* (torchrun's LOCAL_WORLD_SIZE).
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string such as 'auto', 'gloo' or 'nccl', got {backend!r}")
    name = backend.lower()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        if gpus >= world_size and dist.is_nccl_available():
            return "nccl"
        if gpus:
            warnings.warn(
                f"backend='auto' with world_size={world_size} but only {gpus} GPU(s) visible: using gloo "
                f"on the CPU. Pass world_size<={gpus} to run on the GPUs with NCCL.",
                stacklevel=3,
            )
        return "gloo"
    if name in _UNLAUNCHABLE:
        raise ValueError(f"backend={backend!r} cannot run ranks: {_UNLAUNCHABLE[name]}")
    known = _known_backends()
    if name not in known:
        raise ValueError(
            f"backend={backend!r} is not known to torch {torch.__version__}; "
            f"known backends: {', '.join(repr(b) for b in ['auto', *known])}"
        )
    available = [b for b in known if dist.is_backend_available(b)]
    # The GPU count first: on a CPU machine "too few GPUs" is the cause worth naming, not the build.
    if name == "nccl" and gpus < world_size:
        fix = f"use world_size<={gpus}, or " if gpus else "use "
        build = "" if dist.is_nccl_available() else f" (and this torch, {torch.__version__}, has no NCCL)"
        raise ValueError(
            f"world_size={world_size} with backend='nccl' needs one GPU per rank, but {gpus} GPU(s) "
            f"are visible{build}; {fix}backend='gloo' (or 'auto') to run the ranks on the CPU"
        )
    if name not in available:
        raise ValueError(
            f"backend={backend!r} is not built into this torch ({torch.__version__}); "
            f"available here: {', '.join(repr(b) for b in ['auto', *available])}"
        )
    return name


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _cpu_threads_per_rank(world_size: int) -> int:
    """Ranks share the machine's cores; oversubscribing them makes CPU collectives crawl."""
    return max(1, _cpu_count() // world_size)


def _init_process_group(
    backend: str,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    timeout_s: float,
    store: dist.Store | None = None,
) -> RankInfo:
    """Initialise the default group; ``store=None`` means env:// (MASTER_ADDR/MASTER_PORT, torchrun)."""
    for key, value in _RANK_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    device = torch.device("cpu")
    options: dict[str, Any] = {}
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        options["device_id"] = device  # binds the communicator to this GPU up front
    dist.init_process_group(
        backend,
        init_method=None if store is not None else "env://",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **options,
    )
    return RankInfo(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend, device=device)


def _int_env(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is not None:
            return default
        raise RuntimeError(
            f"environment variable {name} is not set: init_from_env() expects torchrun (or another "
            "launcher) to set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. "
            "In a notebook, use sp_lab.launch(fn, world_size=N) instead."
        )
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


def init_from_env(backend: str = "auto", *, timeout: float = 1800.0) -> RankInfo:
    """Initialise the default process group from torchrun's environment (env:// rendezvous).

    Reads RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, picks the backend as :func:`launch` does
    (one GPU per local rank for NCCL), sets the NVLink-multicast-off defaults and, with NCCL, the current
    CUDA device. If a group already exists it is left alone and described. ``timeout`` bounds every
    collective, in seconds.
    """
    if dist.is_initialized():
        backend_now = str(dist.get_backend())
        local_rank = _int_env("LOCAL_RANK", 0)
        device = torch.device("cuda", local_rank) if backend_now == "nccl" else torch.device("cpu")
        return RankInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend_now, device)
    rank, world_size = _int_env("RANK"), _int_env("WORLD_SIZE")
    local_rank = _int_env("LOCAL_RANK", rank)
    local_world_size = _int_env("LOCAL_WORLD_SIZE", world_size)
    resolved = resolve_backend(backend, local_world_size)
    if resolved != "nccl":
        torch.set_num_threads(_cpu_threads_per_rank(local_world_size))
    return _init_process_group(
        resolved, rank=rank, world_size=world_size, local_rank=local_rank, timeout_s=timeout
    )


def run_under_torchrun(fn: Callable[..., Any], *args: Any, backend: str = "auto", **kwargs: Any) -> Any:
    """Under torchrun: initialise the group from the environment, return ``fn(*args, **kwargs)``, clean up.

    The cluster-side twin of :func:`launch`: the same ``fn`` runs unchanged, but each process returns
    only its own rank's result.
    """
    created = not dist.is_initialized()
    init_from_env(backend)
    try:
        return fn(*args, **kwargs)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------
# The caller's side


@dataclasses.dataclass(frozen=True)
class _Job:
    """What every rank receives: the function, its arguments and how to join the group."""

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    backend: str
    timeout_s: float
    store_port: int


class _OutputPump:
    """Forwards one stream of a worker to the caller's, line by line with a ``[rank N]`` prefix.

    Keeps the last lines so error messages can quote what a dying rank printed.
    """

    def __init__(self, source, rank: int, target: Callable[[], TextIO], keep: int):
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.count = 0  # lines seen so far, to find what arrived after a given moment
        self._source = source
        self._prefix = f"[rank {rank}] "
        self._target = target
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
                stream = self._target()
                stream.write(self._prefix + line)
                stream.flush()
        self._source.close()

    def lines_since(self, count: int) -> str:
        new = min(self.count - count, len(self.lines))
        return "".join(list(self.lines)[len(self.lines) - new :]) if new > 0 else ""

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


@dataclasses.dataclass
class _Worker:
    """The caller's handle on one rank."""

    rank: int
    process: subprocess.Popen
    results: Connection
    """Read end of the rank's result pipe."""
    stdout: _OutputPump
    stderr: _OutputPump
    report: tuple | None = None
    """("ok", result) or ("error", exc_type, message, traceback), once received."""

    def stderr_tail(self, lines: int = 20) -> str:
        tail = list(self.stderr.lines)[-lines:]
        return "".join(tail)


def _check_launch_args(fn: Any, world_size: Any, timeout: Any) -> None:
    if not callable(fn):
        raise TypeError(f"launch() needs a callable to run on every rank, got {type(fn).__name__} {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (number of ranks), got {world_size!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _serialise_job(job: _Job) -> bytes:
    try:
        return cloudpickle.dumps(job)
    except Exception as error:
        raise TypeError(
            f"launch() could not serialise {job.fn!r} and its arguments with cloudpickle ({error}). "
            "Arguments must be picklable: pass data (tensors, numbers, configs), not open files, locks "
            "or process groups, and create such things inside the function."
        ) from error


# Started with -c rather than -m so the caller's sys.path (a notebook's sys.path.insert included) is in
# place before sp_lab itself is imported; the same trick multiprocessing's spawn uses.
_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from sp_lab.distributed.launch import _spawned_worker_main; _spawned_worker_main(sys.argv[2:])"
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
    for key, value in _RANK_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    if backend != "nccl":
        env["OMP_NUM_THREADS"] = str(_cpu_threads_per_rank(world_size))
    # TORCHINDUCTOR_CACHE_DIR and everything else the caller set is inherited as is, so ranks share
    # the caller's compile cache.
    return env


def _start_worker(
    rank: int, world_size: int, backend: str, store_port: int, job_path: str, lifeline_fd: int
) -> _Worker:
    read_fd, write_fd = os.pipe()
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _BOOTSTRAP,
                json.dumps(sys.path),
                job_path,
                str(write_fd),
                str(lifeline_fd),
            ],
            env=_worker_env(rank, world_size, backend, store_port),
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
    return _Worker(
        rank=rank,
        process=process,
        results=Connection(read_fd, writable=False),
        stdout=_OutputPump(process.stdout, rank, lambda: sys.stdout, keep=50),
        stderr=_OutputPump(process.stderr, rank, lambda: sys.stderr, keep=_STDERR_TAIL_LINES),
    )


def _receive(worker: _Worker) -> None:
    """Read the rank's report, or record that it died without one."""
    try:
        data = worker.results.recv_bytes()
    except (EOFError, OSError):
        try:
            worker.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
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
        )


def _failure_message(worker: _Worker) -> tuple[str, str | None, int | None]:
    """(message, traceback, exitcode) for a failed rank."""
    kind = worker.report[0]
    if kind == "died":
        exitcode = worker.report[1]
        tail = worker.stderr_tail()
        message = f"rank {worker.rank} {_describe_exit(exitcode)} before reporting a result"
        if tail.strip():
            message += f"; last lines of its stderr:\n{tail.rstrip()}"
        return message, None, exitcode
    _, exc_type, text, tb = worker.report
    return (
        f"rank {worker.rank} raised {exc_type}: {text}\n\nTraceback from rank {worker.rank}:\n{tb.rstrip()}",
        tb,
        None,
    )


def _one_line(worker: _Worker) -> str:
    if worker.report[0] == "died":
        return f"rank {worker.rank} {_describe_exit(worker.report[1])}"
    return f"rank {worker.rank} raised {worker.report[1]}: {str(worker.report[2]).splitlines()[0][:200]}"


def _dump_stacks(workers: Sequence[_Worker]) -> dict[int, str]:
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


def _kill_trees(workers: Sequence[_Worker]) -> None:
    """SIGTERM every worker's process group, wait a little, then SIGKILL what is left."""

    def signal_group(worker: _Worker, sig: int) -> None:
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
        ValueError / TypeError: bad ``world_size``, ``timeout``, ``backend`` or an unpicklable argument,
            before any process starts.
        RankError: a rank raised (its traceback is in the message) or died (its exit code or signal).
        LaunchTimeout: ranks still running at the deadline (their stacks are in the message).

    Worker processes are always cleaned up: on success, on error, on timeout and on Ctrl-C.
    """
    _check_launch_args(fn, world_size, timeout)
    backend = resolve_backend(backend, world_size)
    started = time.monotonic()
    deadline = started + timeout

    # The caller hosts the rendezvous store: port 0 lets the OS pick a free one, with no race.
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )
    job = _Job(fn, args, kwargs, backend, float(timeout), store.port)
    payload = _serialise_job(job)

    workdir = tempfile.mkdtemp(prefix="sp_lab_launch_")
    lifeline_read, lifeline_write = os.pipe()
    workers: list[_Worker] = []
    try:
        job_path = os.path.join(workdir, "job.pkl")
        with open(job_path, "wb") as file:
            file.write(payload)
        for rank in range(world_size):
            workers.append(_start_worker(rank, world_size, backend, store.port, job_path, lifeline_read))
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
            _kill_trees(workers)
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
            shutil.rmtree(workdir, ignore_errors=True)
            del store


def _wait_for_reports(workers: list[_Worker], deadline: float, timeout: float) -> None:
    """Block until every rank reported success; raise on the first failure or at the deadline."""
    pending = {worker.results: worker for worker in workers}
    failures: list[_Worker] = []
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
        first = failures[0]
        message, tb, exitcode = _failure_message(first)
        others = [_one_line(w) for w in failures[1:]]
        if others:
            message += "\n\nAlso failed (often a consequence of the first failure):\n  " + "\n  ".join(others)
        raise RankError(message, rank=first.rank, traceback=tb, exitcode=exitcode, other_failures=others)
    if pending:
        stuck = sorted(pending.values(), key=lambda w: w.rank)
        stacks = _dump_stacks(stuck)
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
# The worker's side


def _watch_lifeline(fd: int) -> None:
    """Kill this worker's whole process group as soon as the caller is gone (its end of the pipe closes)."""

    def watch() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="sp_lab-lifeline", daemon=True).start()


def _to_cpu(value: Any) -> Any:
    """Move tensors in a (nested) result to the CPU so the caller never needs this rank's GPU."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), value)


def _send_error(results: Connection, rank: int, error: BaseException, context: str = "") -> None:
    tb = traceback.format_exc()
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the traceback
        text = "<exception text unavailable>"
    results.send_bytes(cloudpickle.dumps(("error", type(error).__name__, context + text, tb)))


def _exit_now(code: int) -> None:
    """Leave without running atexit hooks or joining threads the user's function may have left."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _spawned_worker_main(argv: Sequence[str]) -> None:
    """Entry point of a rank started by :func:`launch` (see ``_BOOTSTRAP``)."""
    job_path, result_fd, lifeline_fd = argv[0], int(argv[1]), int(argv[2])
    _watch_lifeline(lifeline_fd)
    faulthandler.enable()  # a segfault leaves a Python stack in the stderr tail the caller quotes
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the caller's "where are you stuck?"
    results = Connection(result_fd, readable=False)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    try:
        with open(job_path, "rb") as file:
            job: _Job = cloudpickle.load(file)
    except BaseException as error:  # noqa: BLE001 - reported to the caller, which raises it
        _send_error(results, rank, error, context="could not load the function and its arguments: ")
        _exit_now(1)

    try:
        if job.backend != "nccl":
            torch.set_num_threads(_cpu_threads_per_rank(world_size))
        store = dist.TCPStore(
            "127.0.0.1",
            job.store_port,
            world_size,
            False,
            timeout=datetime.timedelta(seconds=job.timeout_s),
        )
        _init_process_group(
            job.backend,
            rank=rank,
            world_size=world_size,
            local_rank=int(os.environ["LOCAL_RANK"]),
            timeout_s=job.timeout_s,
            store=store,
        )
        result = job.fn(*job.args, **job.kwargs)
    except BaseException as error:  # noqa: BLE001 - SystemExit / KeyboardInterrupt in fn are failures too
        _send_error(results, rank, error)
        _exit_now(1)  # no group teardown: peers may be stuck in a collective; the caller kills them

    try:
        data = cloudpickle.dumps(("ok", _to_cpu(result)))
    except BaseException as error:  # noqa: BLE001 - reported to the caller, which raises it
        _send_error(
            results,
            rank,
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
