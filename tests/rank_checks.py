"""One launch of 2 gloo ranks for the rank checks of several test modules.

Every ``sp_lab.launch`` starts two interpreters, and each pays Inductor's start-up at its first compile (about
7 s on an idle 2-core machine, 20-30 s under load) before its checks run. A test module registers its rank
function at import instead of launching it itself::

    rank_checks.register(__name__, _numerics_worker, NUMERIC_CASES, timeout=900.0)

and its fixture reads its own results from the session's one launch (the ``gloo_checks`` fixture of
``tests/conftest.py``)::

    @pytest.fixture(scope="module")
    def gloo(gloo_checks):
        return rank_checks.results_of(gloo_checks, __name__)

The launch runs the functions of the modules that have selected tests, one after the other, with Dynamo reset
between them. A function that raises fails only its own module's tests (with the rank's traceback); the others'
results stand. Within a module, a function that runs several cases (a parametrised test's) runs each through
:func:`run_cases`, and each test reads its own case with :func:`case_results`: a case that raises fails that case's
test, named, with its traceback, and the module's other cases report their own results. (A case that raises on one
rank while the other waits in a collective still stalls the launch until its timeout: the cases share the ranks.)

The session starts that launch in the background at the first notebook test (:func:`start_once`) and runs the
notebook tests beside it (``conftest.py``): their kernels and browsers leave cores idle that the ranks' compiles
fill. In one process the other tests start once it has ended (:func:`wait`): two launches overlapping in one
process crossed their gloo rendezvous once in about fifteen tries (rank 1 of one met the other's rank 0), while
launches from other processes (notebook kernels, the other pytest-xdist worker) run beside it. The tests that read
its results come after the notebook tests (:func:`result`).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

WORLD_SIZE = 2


class Registered(NamedTuple):
    """A module's rank function, its arguments (or the ``prepare`` that makes them) and its share of the timeout."""

    fn: Callable[..., Any]
    args: tuple | Callable[[], tuple]
    timeout: float


class Check(NamedTuple):
    """What a rank runs for one module: its function and arguments."""

    module: str
    fn: Callable[..., Any]
    args: tuple


class CheckResult(NamedTuple):
    """One module's checks on one rank: whether they ran through, what they returned (else the rank's
    traceback) and how long they took."""

    ok: bool
    value: Any
    seconds: float


class CaseError(NamedTuple):
    """What a case that raised on a rank left in place of its results: the rank's traceback."""

    case: str
    traceback: str


Case = TypeVar("Case")


PerRank = list[dict[str, CheckResult]]
"""A launch's results: per rank, ``{module: CheckResult}``."""

_REGISTERED: dict[str, Registered] = {}
_started: Future | None = None


def register(module: str, fn: Callable[..., Any], *args: Any, timeout: float,
             prepare: Callable[[], tuple] | None = None) -> None:
    """Run ``fn(*args)`` on every rank of the shared launch for the tests of ``module`` (its ``__name__``).

    ``prepare``: called in the test process just before the launch, returns the arguments instead of ``args``
    (e.g. the path of a checkpoint it wrote, which must not be written at import)."""
    _REGISTERED[module] = Registered(fn, prepare if prepare is not None else args, timeout)


def scratch_dir(prefix: str) -> Path:
    """A new directory for a module's ``prepare`` to hand its ranks (a checkpoint, a cache of their own), removed
    when the test process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


def total_timeout() -> float:
    """The shared launch's longest run: the timeouts of every registered check, added."""
    return sum(registered.timeout for registered in _REGISTERED.values())


def _run_on_rank(checks: list[Check]) -> dict[str, CheckResult]:
    """On each rank: every check in turn."""
    import torch

    out = {}
    for check in checks:
        torch._dynamo.reset()  # each module's checks start from a clean Dynamo, as in a launch of their own
        start = time.monotonic()
        try:
            out[check.module] = CheckResult(True, check.fn(*check.args), time.monotonic() - start)
        except Exception:  # noqa: BLE001 - reported to that module's tests, the others go on
            out[check.module] = CheckResult(False, traceback.format_exc(), time.monotonic() - start)
    return out


def _checks_of(modules: Iterable[str]) -> list[Check]:
    """The registered checks of ``modules``, each ``prepare`` called here."""
    checks = []
    for module in sorted(set(modules) & set(_REGISTERED)):
        registered = _REGISTERED[module]
        args = registered.args() if callable(registered.args) else registered.args
        checks.append(Check(module, registered.fn, args))
    return checks


def _launch(checks: list[Check]) -> PerRank:
    import sp_lab

    if not checks:
        return [{} for _ in range(WORLD_SIZE)]
    timeout = sum(_REGISTERED[check.module].timeout for check in checks)
    return sp_lab.launch(_run_on_rank, checks, world_size=WORLD_SIZE, backend="gloo", timeout=timeout)


def launch_for(modules: Iterable[str]) -> PerRank:
    """One launch running the registered checks of ``modules``."""
    return _launch(_checks_of(modules))


def start_once(modules: Iterable[str]) -> None:
    """Start the launch of :func:`launch_for` in a background thread unless one was started; :func:`result` waits
    for it.

    The ``prepare`` functions run here, in the caller's thread. The thread is a daemon: a session that ends
    before reading the results does not wait for the ranks (they end with the caller, as every launch's do)."""
    global _started
    if _started is not None:
        return
    checks = _checks_of(modules)
    started: Future = Future()
    started.set_running_or_notify_cancel()

    def run() -> None:
        try:
            started.set_result(_launch(checks))
        except BaseException as e:  # noqa: BLE001 - handed to the tests that read the results
            started.set_exception(e)

    threading.Thread(target=run, name="rank-checks-launch", daemon=True).start()
    _started = started


def wait() -> None:
    """Return once the launch :func:`start_once` began has ended (at once if none was started or it has ended)."""
    if _started is not None:
        _started.exception()  # waits; its failure is for the tests that read the results


def result(modules: Iterable[str]) -> PerRank:
    """The results of the launch :func:`start_once` began (waiting for it), or of a launch for ``modules`` now."""
    return _started.result() if _started is not None else launch_for(modules)


def results_of(per_rank: PerRank, module: str) -> list[Any]:
    """``module``'s results, one per rank; raises with the rank's traceback if its checks raised there."""
    results = []
    for rank, checks in enumerate(per_rank):
        if module not in checks:
            raise RuntimeError(f"{module} registered no rank checks (rank_checks.register at import) or was not "
                               "selected when the shared launch started")
        got = checks[module]
        if not got.ok:
            raise RuntimeError(f"the rank checks of {module} raised on rank {rank}:\n{got.value}")
        results.append(got.value)
    return results


def run_cases(cases: Iterable[Case], key: Callable[[Case], Hashable], run_case: Callable[[Case], Any]) -> dict:
    """On a rank: ``{key(case): run_case(case)}`` for every case, in order; a case that raises is recorded as a
    :class:`CaseError` (with the case's key and the traceback) and the next case runs."""
    out: dict = {}
    for case in cases:
        name = key(case)
        try:
            out[name] = run_case(case)
        except Exception:  # noqa: BLE001 - reported to that case's test, the other cases go on
            out[name] = CaseError(str(name), traceback.format_exc())
    return out


def case_results(per_rank: list[dict], key: Hashable) -> list[Any]:
    """Case ``key``'s results (from :func:`run_cases`), one per rank. Fails the calling test naming the case and
    the rank, with the rank's traceback, if the case raised there."""
    import pytest

    results = []
    for rank, cases in enumerate(per_rank):
        if key not in cases:
            raise KeyError(f"no rank-check case {key!r}; the ranks ran {sorted(map(str, cases))}")
        got = cases[key]
        if isinstance(got, CaseError):
            pytest.fail(f"rank-check case {got.case} raised on rank {rank}:\n{got.traceback}", pytrace=False)
        results.append(got)
    return results
