"""Ranks forked from the warm fork server get what a fresh interpreter got: the caller's environment, working
directory and sys.path as of each launch (sp_lab.distributed.forkserver)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import sp_lab
from sp_lab.distributed import LaunchTimeout, forkserver

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


def test_a_deadline_that_passes_while_the_server_starts_is_a_launch_timeout_and_the_next_launch_works(monkeypatch):
    """The first launch of a process waits for its fork server to import torch: a timeout shorter than that ends it
    as a LaunchTimeout (not after the server's own 5 minutes), and the server, whose late reply belongs to no
    request any more, is not used again."""
    monkeypatch.delenv("SP_LAB_FORKSERVER", raising=False)
    monkeypatch.setenv("SP_LAB_TEST_PROBE", f"fresh server {os.getpid()} {id(monkeypatch)}")  # a new server
    with pytest.raises(LaunchTimeout, match="before rank 0 of 2 had started") as info:
        sp_lab.launch(_what_the_rank_sees, world_size=2, backend="gloo", timeout=0.2)
    assert tuple(info.value.ranks) == (0, 1)
    slow_server = forkserver.server_pid()
    ranks = sp_lab.launch(_what_the_rank_sees, world_size=2, backend="gloo")
    assert forkserver.server_pid() != slow_server
    assert [r["parent"] for r in ranks] == [forkserver.server_pid()] * 2
