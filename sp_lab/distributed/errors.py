"""The errors :func:`sp_lab.launch` raises once ranks have started, and how a rank's exit is described."""

from __future__ import annotations

import signal
from collections.abc import Sequence

__all__ = ["LaunchError", "LaunchTimeout", "RankError", "describe_exit"]


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
        during_rendezvous: every failing rank raised while the ranks formed their process group, before the
            function ran (nothing of the user's ran yet: :func:`launch` starts the ranks again once).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        traceback: str | None = None,
        exitcode: int | None = None,
        other_failures: Sequence[str] = (),
        during_rendezvous: bool = False,
    ):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.exitcode = exitcode
        self.other_failures = tuple(other_failures)
        self.during_rendezvous = during_rendezvous

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


def describe_exit(exitcode: int | None) -> str:
    sig = _signal_of(exitcode)
    if sig is not None:
        hint = " (often the kernel's out-of-memory killer)" if sig == signal.SIGKILL else ""
        return f"was killed by signal {sig.name}{hint} (exit code {exitcode})"
    if exitcode is None:
        return "closed its result pipe but did not exit"
    return f"exited with code {exitcode}"

