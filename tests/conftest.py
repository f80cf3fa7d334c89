"""Fixtures shared by the test modules, and the session's order around the shared launch of rank checks."""

from __future__ import annotations

import signal

import pytest
import rank_checks

_WAITS = pytest.StashKey[bool]()
_READERS = pytest.StashKey[frozenset[str]]()
RANK_CHECKS_GROUP = "rank-checks"


def _reads_gloo_checks(item: pytest.Item) -> bool:
    return "gloo_checks" in item.fixturenames


def _in_rank_checks_group(item: pytest.Item) -> bool:
    """The notebook tests and the tests that read the launch's results: one xdist group, on the launching worker."""
    return bool(item.get_closest_marker("notebooks")) or _reads_gloo_checks(item)


def _readers(items: list[pytest.Item]) -> set[str]:
    """The modules whose tests read the shared launch's results."""
    return {item.module.__name__ for item in items if _reads_gloo_checks(item)}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the session around the shared launch of rank checks (tests/rank_checks.py), started in the background
    at the first notebook test: first the notebook tests, whose kernels start their own ranks in other processes,
    beside it; then, once it has ended, the modules that read its results (launches from this process never
    overlap it), then the others. Each module stays whole (its module fixtures are set up once).

    With pytest-xdist (``--dist loadgroup --no-loadscope-reorder``, as ``make test`` runs it) the notebook tests and
    the tests that read the launch's results are one group, run first and in this order on one worker (the one
    that launches); the rest of each module is a group of its own, run on whichever worker is free, beside the
    launch: the readers' in-process compiles (the heaviest) first, so the two workers end close together."""
    readers = config.stash[_READERS] = frozenset(_readers(items))
    items.sort(key=lambda item: (0 if item.get_closest_marker("notebooks") else 1 if item.module.__name__ in readers
                                 else 2))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(RANK_CHECKS_GROUP if _in_rank_checks_group(item)
                                                else item.module.__name__))
    # The first test after the notebook tests waits for what is left of the launch (every module's rank checks),
    # far past one test's timeout, as do the tests that read its results: their limit is the launch's own (which
    # ends a hung rank anyway).
    limit = rank_checks.total_timeout() + 120
    first_after_notebooks = next((item for item in items if not item.get_closest_marker("notebooks")), None)
    for item in items:
        if _reads_gloo_checks(item) or item is first_after_notebooks:
            item.add_marker(pytest.mark.timeout(limit))
    if first_after_notebooks is not None:
        first_after_notebooks.stash[_WAITS] = True


def pytest_runtest_setup(item: pytest.Item) -> None:
    readers = item.config.stash.get(_READERS, frozenset())
    if readers and _in_rank_checks_group(item):
        # The group's first test starts the launch (a no-op after): under pytest-xdist every worker collects
        # every test, and only the one that runs the group may launch.
        rank_checks.start_once(readers)
    if item.stash.get(_WAITS, False):
        rank_checks.wait()


@pytest.fixture(scope="session")
def gloo_checks(request: pytest.FixtureRequest) -> rank_checks.PerRank:
    """One launch of 2 gloo ranks running the registered rank checks of every selected module that uses this
    fixture (tests/rank_checks.py), started in the background at the first notebook test: one pair of
    interpreters and one Inductor start-up instead of one per module, its compiles beside the notebook tests."""
    return rank_checks.result(request.config.stash[_READERS])


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt in this process for the test, as in a notebook kernel (whose interrupt
    button sends SIGINT and which installs its own handler). A session started in the background by a shell
    without job control (``cmd &`` in a script) inherits SIGINT ignored, and Python then keeps it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
