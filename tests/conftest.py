"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import rank_checks

_WAITS = pytest.StashKey[bool]()


def _reads_gloo_checks(item: pytest.Item) -> bool:
    return "gloo_checks" in item.fixturenames


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the session around the shared launch of rank checks (tests/rank_checks.py), started in the background
    before the first test: first the notebook tests, whose kernels start their own ranks in other processes, beside
    it; then, once it has ended, the other modules (launches from this process never overlap it); its readers last.
    Each module stays whole (its module fixtures are set up once)."""
    late = {item.module.__name__ for item in items if _reads_gloo_checks(item)}
    items.sort(key=lambda item: (0 if item.get_closest_marker("notebooks") else 2 if item.module.__name__ in late
                                 else 1))
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


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    modules = {item.module.__name__ for item in session.items if _reads_gloo_checks(item)}
    if modules:
        rank_checks.start(modules)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.stash.get(_WAITS, False):
        rank_checks.wait()


@pytest.fixture(scope="session")
def gloo_checks(request: pytest.FixtureRequest) -> list[dict]:
    """One launch of 2 gloo ranks running the registered rank checks of every selected module that uses this
    fixture (tests/rank_checks.py), started in the background before the first test: one pair of interpreters
    and one Inductor start-up instead of one per module, its compiles beside the notebook tests."""
    modules = {item.module.__name__ for item in request.session.items if _reads_gloo_checks(item)}
    return rank_checks.result(modules)
