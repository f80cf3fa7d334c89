"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import rank_checks


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The first test that needs the shared launch waits for all of it (every module's rank checks), far past the
    # per-test timeout of one module's checks: its limit is the launch's own (which ends a hung rank anyway).
    limit = rank_checks.total_timeout() + 120
    for item in items:
        if "gloo_checks" in item.fixturenames:
            item.add_marker(pytest.mark.timeout(limit))


@pytest.fixture(scope="session")
def gloo_checks(request: pytest.FixtureRequest) -> list[dict]:
    """One launch of 2 gloo ranks running the registered rank checks of every selected module that uses this
    fixture (tests/rank_checks.py): one pair of interpreters and one Inductor start-up instead of one per module."""
    modules = {item.module.__name__ for item in request.session.items if "gloo_checks" in item.fixturenames}
    return rank_checks.launch_for(modules)
