"""Ranks forked from the warm fork server get what a fresh interpreter got: the caller's environment, working
directory and sys.path as of each launch (sp_lab.distributed.forkserver)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import sp_lab
from sp_lab.distributed import forkserver

pytestmark = pytest.mark.skipif(sys.platform != "linux" or torch.cuda.is_available(),
                                reason="no fork server here (not Linux, or a CUDA device: ranks start fresh)")


def _what_the_rank_sees() -> dict:
    return {"probe": os.environ.get("SP_LAB_TEST_PROBE"), "cwd": os.getcwd(), "path_tail": sys.path[-1],
            "parent": os.getppid(), "session_leader": os.getsid(0) == os.getpid()}


def test_forked_ranks_see_the_callers_environment_directory_and_path_as_of_each_launch(monkeypatch, tmp_path):
    monkeypatch.delenv("SP_LAB_FORKSERVER", raising=False)
    monkeypatch.setenv("SP_LAB_TEST_PROBE", "first")
    first = sp_lab.launch(_what_the_rank_sees, world_size=2, backend="gloo")
    server = forkserver.server_pid()
    assert server is not None
    assert all(r["parent"] == server and r["session_leader"] and r["probe"] == "first" for r in first), first

    again = sp_lab.launch(_what_the_rank_sees, world_size=2, backend="gloo")
    assert forkserver.server_pid() == server, "nothing changed: the warm server is reused"
    assert [r["parent"] for r in again] == [server, server]

    # What the server imported torch under changed: a new server, and the ranks see the caller as it is now.
    monkeypatch.setenv("SP_LAB_TEST_PROBE", "second")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "last")])
    changed = sp_lab.launch(_what_the_rank_sees, world_size=2, backend="gloo")
    assert forkserver.server_pid() not in (None, server)
    # The replaced server is gone (exited and reaped), not left holding its imports until this process exits.
    with pytest.raises(ProcessLookupError):
        os.kill(server, 0)
    for r in changed:
        assert (r["probe"], r["cwd"], r["path_tail"]) == ("second", str(tmp_path), str(tmp_path / "last")), r


def test_switched_off_every_rank_is_a_fresh_interpreter_of_the_caller(monkeypatch):
    monkeypatch.setenv("SP_LAB_FORKSERVER", "0")
    ranks = sp_lab.launch(_what_the_rank_sees, world_size=2, backend="gloo")
    assert [r["parent"] for r in ranks] == [os.getpid(), os.getpid()]
    assert all(r["session_leader"] for r in ranks)
