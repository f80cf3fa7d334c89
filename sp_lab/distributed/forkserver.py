"""A warm template process that forks :func:`sp_lab.launch`'s ranks with torch, Dynamo and Inductor imported.

A rank started as a fresh interpreter spends its first seconds importing torch, torch.distributed, Dynamo and
Inductor (about 5 s of one core on an idle 2-core machine, more under load) before the user's function runs,
and every ``launch()`` paid that again for every rank. The fork server is started once per caller (a notebook
kernel, a test session, the CLI) on its first launch, imports those modules once, and forks one child per
rank on request: each child starts with them imported. ``benchmarks/bench_launch.py`` times both ways.

Why forking is safe here and nowhere else: the server is a fresh interpreter that only imports modules. It
never runs a kernel, starts no thread pool and never initialises CUDA (checked before every fork), so a child
inherits no lock held by another thread and no GPU context. ``launch()`` never forks the caller itself, whose
threads and CUDA state are unknown.

A forked rank gets what a fresh interpreter started with :class:`subprocess.Popen` got: the caller's
``sys.path``, environment and working directory as of this launch, ``/dev/null`` as stdin, its own pipes as
stdout and stderr, its own session (clean-up kills its process tree), and its result and lifeline pipes
(passed over a Unix socket with ``SCM_RIGHTS``). A server is tied to what was fixed when it imported torch --
the interpreter, ``sys.path`` and the whole environment (torch and Inductor read ``TORCH*`` variables at
import): when any of them differs at the next launch, a new server replaces it.

A forked rank is the server's child, not the caller's: the server reaps it and sends its exit status back,
where :class:`ForkedRank` (the part of :class:`subprocess.Popen` that ``launch()`` uses) picks it up.

``SP_LAB_FORKSERVER=0`` starts every rank as a fresh interpreter instead, as happens on a machine with a CUDA
device (see :func:`enabled`) and where fork or passing descriptors over a socket is not available (anything but
Linux). Small CPU machines are where start-up time matters most: a GPU machine's many cores import in parallel.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO

__all__ = ["ForkedRank", "enabled", "server_pid", "start_rank"]

# What every rank imports before the user's function runs (a rank that compiles imports all of it).
PRELOAD = ("torch", "torch.distributed", "cloudpickle", "sp_lab.distributed.worker", "torch._dynamo",
           "torch._inductor.compile_fx", "sp_lab.compiler.backend")

_HEADER = struct.Struct("!Q")  # the length of the JSON message that follows


@dataclasses.dataclass(frozen=True)
class _Request:
    """What a rank needs that the server's own process state does not already give it."""

    argv: list[str]
    """``worker_main``'s arguments, the two descriptor numbers excepted (the child's own are used)."""
    env: dict[str, str]
    sys_path: list[str]
    cwd: str


def enabled() -> bool:
    """Whether ranks are forked from a warm server: on Linux, without a CUDA device, unless switched off.

    With a CUDA device they start as fresh interpreters: a process forked after torch has asked the CUDA
    driver about its devices cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess", in every
    forked rank on an H200 machine), and importing Inductor asks."""
    import torch

    return (os.environ.get("SP_LAB_FORKSERVER", "1") != "0" and sys.platform == "linux"
            and hasattr(socket, "send_fds") and not torch.cuda.is_available())


# -- messages: a length, then JSON --------------------------------------------------------------------------


def _send(sock: socket.socket, message: Any, fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    header = _HEADER.pack(len(data))
    if fds:
        socket.send_fds(sock, [header], fds)
    else:
        sock.sendall(header)
    sock.sendall(data)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise EOFError("the other end closed the fork server's socket")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket, max_fds: int = 0) -> tuple[Any, list[int]]:
    """One message and the descriptors that came with its header; EOFError when the other end is gone."""
    if max_fds:
        header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, max_fds)
        if not header:
            raise EOFError("the other end closed the fork server's socket")
        header += _recv_exactly(sock, _HEADER.size - len(header))
    else:
        header, fds = _recv_exactly(sock, _HEADER.size), []
    (length,) = _HEADER.unpack(header)
    return json.loads(_recv_exactly(sock, length)), list(fds)


# -- the caller's side ----------------------------------------------------------------------------------------


class ForkedRank:
    """The caller's handle on a rank forked by the server: ``pid``, ``stdout``/``stderr`` (binary read ends),
    ``poll``, ``wait``, ``send_signal`` and ``returncode``, as :class:`subprocess.Popen` has them."""

    def __init__(self, server: _Server, pid: int, stdout: BinaryIO, stderr: BinaryIO):
        self._server = server
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._server.changed:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"rank process {self.pid}", timeout)
                if self._server.lost and not _alive(self.pid):
                    break  # its exit status went with the server; it is gone all the same
                self._server.changed.wait(left if left is None else min(left, 0.5))
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Server:
    """The caller's end of one fork server: its process, its socket and the exit statuses it reported."""

    def __init__(self, key: tuple) -> None:
        self.key = key
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,  # Ctrl-C in a notebook is for the ranks' caller, not for the server
            )
        finally:
            theirs.close()
        self._sock = ours
        self._request_lock = threading.Lock()  # one request, one reply
        self.changed = threading.Condition()
        self._replies: list[Any] = []
        self._exits: dict[int, int] = {}
        self.lost = False
        threading.Thread(target=self._read, name="sp_lab-forkserver", daemon=True).start()

    def _read(self) -> None:
        """Replies to requests and exit statuses, as the server sends them."""
        try:
            while True:
                message, _ = _recv(self._sock)
                with self.changed:
                    if message[0] == "exited":
                        self._exits[message[1]] = message[2]
                    else:
                        if message[0] == "started":  # a reused pid: its old status is not this child's
                            self._exits.pop(message[1], None)
                        self._replies.append(message)
                    self.changed.notify_all()
        except (EOFError, OSError):
            with self.changed:
                self.lost = True
                self.changed.notify_all()

    def exit_code(self, pid: int) -> int | None:
        with self.changed:
            return self._exits.get(pid)

    def fork(self, request: _Request, fds: list[int], timeout: float) -> int:
        """Ask for one rank; its pid. Raises :class:`TimeoutError` when no reply comes within ``timeout``."""
        with self._request_lock:
            _send(self._sock, dataclasses.asdict(request), fds)
            try:
                reply = self._reply(timeout)
            except BaseException:
                # This request's reply may still come, and the next request would take it for its own: the
                # server is not used again (the next launch starts a new one).
                self.lost = True
                raise
        if reply[0] != "started":
            raise RuntimeError(f"the rank fork server could not start a rank: {reply[1]}")
        return reply[1]

    def _reply(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not self._replies:
                left = deadline - time.monotonic()
                if self.lost:
                    raise RuntimeError("the rank fork server exited before it answered; "
                                       "SP_LAB_FORKSERVER=0 starts ranks as fresh interpreters instead")
                if left <= 0:
                    raise TimeoutError(f"the rank fork server did not answer within {timeout:.1f} s")
                self.changed.wait(left)
            return self._replies.pop(0)

    def close(self) -> None:
        """The server exits when it reads EOF; ranks it forked run on to their own end (or their lifeline's).

        ``shutdown`` first: the reader thread is blocked in ``recv`` on this socket, and on Linux a ``close``
        alone leaves the connection open while a call is using it, so the server never read EOF and stayed
        (torch imported, a few hundred MB) until the caller exited. Then reaped, so no zombie is left behind."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=_EXIT_TIMEOUT_S)


_server: _Server | None = None
_server_lock = threading.Lock()
# Importing torch, Dynamo and Inductor in the server, plus the first request: generous for a loaded machine.
_START_TIMEOUT_S = 300.0
# A server leaves as soon as it reads EOF; one busy forking a rank at that moment is left to exit on its own.
_EXIT_TIMEOUT_S = 5.0


# Variables that change while a process runs without changing what an import reads (SP_LAB_FORKSERVER is
# read at each launch).
_VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST", "SP_LAB_FORKSERVER"})


def _current_key() -> tuple:
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k not in _VOLATILE_ENV))
    return (sys.executable, tuple(sys.path), env)


def _get_server() -> _Server:
    global _server
    with _server_lock:
        key = _current_key()
        if _server is not None and (_server.key != key or _server.lost or _server.process.poll() is not None):
            _server.close()
            _server = None
        if _server is None:
            _server = _Server(key)
        return _server


def server_pid() -> int | None:
    """The fork server's process id while one runs for this process (it outlives each launch)."""
    return _server.process.pid if _server is not None and _server.process.poll() is None else None


@atexit.register
def _stop_server() -> None:
    if _server is not None:
        _server.close()


def start_rank(argv: list[str], env: dict[str, str], result_fd: int, lifeline_fd: int,
               timeout: float = _START_TIMEOUT_S) -> ForkedRank:
    """Fork a rank that runs ``worker_main(argv + [result fd, lifeline fd])`` with ``env``.

    ``result_fd`` and ``lifeline_fd`` are the caller's descriptors the rank writes its report to and watches;
    the caller closes its copy of ``result_fd`` afterwards, as with Popen's ``pass_fds``. ``timeout``: seconds to
    wait for the rank's start (a new server imports torch first), at most ``_START_TIMEOUT_S``; past it
    :class:`TimeoutError`."""
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        request = _Request(argv=list(argv), env=dict(env), sys_path=list(sys.path), cwd=os.getcwd())
        server = _get_server()
        pid = server.fork(request, [out_write, err_write, result_fd, lifeline_fd], min(timeout, _START_TIMEOUT_S))
    except BaseException:
        for fd in (out_read, err_read):
            os.close(fd)
        raise
    finally:
        for fd in (out_write, err_write):
            os.close(fd)
    return ForkedRank(server, pid, os.fdopen(out_read, "rb"), os.fdopen(err_read, "rb"))  # type: ignore[arg-type]


# -- the server's side ----------------------------------------------------------------------------------------

_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from sp_lab.distributed.forkserver import _serve; _serve(int(sys.argv[2]))"
)


def _serve(sock_fd: int) -> None:
    """The server's loop: fork a rank per request, report each child's exit, leave when the caller is gone."""
    import importlib

    sock = socket.socket(fileno=sock_fd)
    for name in PRELOAD:
        importlib.import_module(name)
    import torch

    # Done once here, inherited by every rank: what each rank's first compile would do (Inductor probes the
    # CPU's vector instruction sets, a short subprocess each).
    with contextlib.suppress(Exception):
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()

    # SIGCHLD wakes the loop through a pipe, so exits are reported as they happen.
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    while True:
        ready, _, _ = select.select([sock, wake_read], [], [])
        if wake_read in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_read, 4096)
        _report_exits(sock)
        if sock not in ready:
            continue
        try:
            message, fds = _recv(sock, max_fds=4)
            request = _Request(**message)
        except (EOFError, OSError):
            os._exit(0)  # the caller is gone; its ranks have their own lifeline
        if torch.cuda.is_initialized() or len(fds) != 4:
            _send(sock, ("failed", "CUDA initialised in the fork server" if len(fds) == 4
                         else f"expected 4 descriptors, got {len(fds)}"))
        else:
            pid = os.fork()
            if pid == 0:
                _become_rank(request, fds, [sock.fileno(), wake_read, wake_write])
            _send(sock, ("started", pid))
        for fd in fds:
            os.close(fd)


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            _send(sock, ("exited", pid, os.waitstatus_to_exitcode(status)))
        except OSError:  # the caller closed this server (it was replaced or is gone): nobody to tell
            os._exit(0)


def _become_rank(request: _Request, fds: list[int], server_fds: list[int]) -> None:
    """In the forked child: become what a fresh rank interpreter would have been, then run the rank."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in server_fds:
            os.close(fd)
        os.setsid()
        stdout, stderr, result_fd, lifeline_fd = fds
        devnull = os.open(os.devnull, os.O_RDONLY)
        for source, target in ((devnull, 0), (stdout, 1), (stderr, 2)):
            os.dup2(source, target)
            os.close(source)
        os.chdir(request.cwd)
        os.environ.clear()
        os.environ.update(request.env)
        sys.path[:] = request.sys_path
        import random

        random.seed()  # a fresh interpreter seeds from the OS; siblings must not share one sequence
        from sp_lab.distributed.worker import worker_main

        worker_main([*request.argv, str(result_fd), str(lifeline_fd)])
    finally:
        os._exit(1)  # never back into the server's loop
