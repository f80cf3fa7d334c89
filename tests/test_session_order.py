"""The suite's own layout (``tests/conftest.py``, ``tests/rank_checks.py``) under pytest-xdist, as ``make test`` runs
it: the shared launch of rank checks happens once per session, on the worker that runs the notebook tests and the
tests that read its results.

A session of its own in a subprocess, on a copy of the two files: a notebook test, a module that registers a rank
check and reads it from two tests, and plain modules. Each rank of each launch appends a line to a log; each test
writes which worker ran it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

READER = '''
import os
import pytest
import rank_checks


def _check():
    import torch.distributed as dist
    with open(os.environ["RANK_LOG"], "a") as log:
        log.write(f"rank {dist.get_rank()}\\n")
    return os.getpid()


rank_checks.register(__name__, _check, timeout=120.0)


@pytest.fixture(scope="module")
def ranks(gloo_checks):
    return rank_checks.results_of(gloo_checks, __name__)


def test_reads(ranks, worker):
    assert len(ranks) == 2


def test_reads_again(ranks, worker):
    assert len(set(ranks)) == 2


def test_plain_in_a_readers_module(worker):
    pass
'''

NOTEBOOK = '''
import pytest


@pytest.mark.notebooks
def test_notebook(worker):
    pass
'''

PLAIN = '''
def test_plain(worker):
    pass
'''

FIXTURE = '''

import os
from pathlib import Path


@pytest.fixture
def worker(request):
    """Which xdist worker ran this test, written to WORKER_DIR/<module>.<test>."""
    name = f"{request.module.__name__}.{request.node.name}"
    Path(os.environ["WORKER_DIR"], name).write_text(os.environ.get("PYTEST_XDIST_WORKER", "main"))
'''


def test_under_xdist_the_rank_checks_launch_once_on_the_worker_of_the_notebooks_and_readers(tmp_path):
    session = tmp_path / "session"
    session.mkdir()
    shutil.copy(HERE / "rank_checks.py", session)
    (session / "conftest.py").write_text((HERE / "conftest.py").read_text() + FIXTURE)
    (session / "pytest.ini").write_text("[pytest]\nmarkers =\n    notebooks: notebook tests\n")
    (session / "test_a_notebook.py").write_text(NOTEBOOK)
    (session / "test_b_reader.py").write_text(READER)
    for name in ("c", "d", "e"):
        (session / f"test_{name}_plain.py").write_text(PLAIN)
    log, workers = tmp_path / "ranks.log", tmp_path / "workers"
    workers.mkdir()
    env = {**os.environ, "RANK_LOG": str(log), "WORKER_DIR": str(workers)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         "--no-loadscope-reorder"],
        check=False, cwd=session, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(log.read_text().splitlines()) == ["rank 0", "rank 1"], \
        f"the rank checks were not launched exactly once:\n{log.read_text()}"
    ran_on = {p.name: p.read_text() for p in workers.iterdir()}
    assert len(ran_on) == 7, ran_on
    group = {ran_on[t] for t in ("test_a_notebook.test_notebook", "test_b_reader.test_reads",
                                 "test_b_reader.test_reads_again")}
    assert len(group) == 1 and group != {"main"}, ran_on
