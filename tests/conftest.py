"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import rank_checks


def _reads_gloo_checks(item: pytest.Item) -> bool:
    return "gloo_checks" in item.fixturenames


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The first test that needs the shared launch waits for what is left of it (every module's rank checks), far
    # past the per-test timeout of one module's checks: its limit is the launch's own (which ends a hung rank anyway).
    limit = rank_checks.total_timeout() + 120
    for item in items:
        if _reads_gloo_checks(item):
            item.add_marker(pytest.mark.timeout(limit))
    # The modules that read the shared launch run last, each whole (its module fixtures set up once), so that
    # the launch, started before the first test, runs beside every other module.
    late = {item.module.__name__ for item in items if _reads_gloo_checks(item)}
    items.sort(key=lambda item: item.module.__name__ in late)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    modules = {item.module.__name__ for item in session.items if _reads_gloo_checks(item)}
    if modules:
        rank_checks.start(modules)


@pytest.fixture(scope="session")
def gloo_checks(request: pytest.FixtureRequest) -> list[dict]:
    """One launch of 2 gloo ranks running the registered rank checks of every selected module that uses this
    fixture (tests/rank_checks.py), started in the background before the first test: one pair of interpreters
    and one Inductor start-up instead of one per module, its compiles beside the other modules' tests."""
    modules = {item.module.__name__ for item in request.session.items if _reads_gloo_checks(item)}
    return rank_checks.result(modules)
