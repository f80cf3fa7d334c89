"""sp_lab.launch: results, errors, timeouts and clean-up, on 2 CPU ranks with gloo.

Each launch starts fresh interpreters (~3 s on 2 cores), so every test here earns its launch.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import sp_lab
from sp_lab.distributed import LaunchTimeout, RankError, forkserver, resolve_backend

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------
# Helpers: what is still alive


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) for every process, read from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # exited while we looked
            continue
        # The command name is in parentheses and may hold spaces; fields after it are fixed.
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        table[int(entry)] = (int(ppid), state)
    return table


def _live_descendants(pid: int) -> list[int]:
    table = _process_table()
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, state) in table.items():
            if ppid == parent and state != "Z":
                found.append(child)
                frontier.append(child)
    return found


def left_behind(before: set[int], grace_s: float = 2.0) -> set[int]:
    """This process's live descendants that were not there ``before`` and are still there after ``grace_s``:
    what a test left behind. The fork server outlives each launch by design; the ranks it forked are counted."""
    deadline = time.monotonic() + grace_s  # reaping is synchronous in launch(), but be fair to the kernel
    while (left := set(_live_descendants(os.getpid())) - before - {forkserver.server_pid()}) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Every test must leave no worker (or worker's child) behind."""
    before = set(_live_descendants(os.getpid()))
    yield
    left = left_behind(before)
    assert not left, f"launch() left processes behind: {sorted(left)}"


# ---------------------------------------------------------------------------------------------------
# Functions the ranks run. Module-level ones travel by reference (this module is importable in the
# workers because they inherit sys.path); closures and lambdas travel by value.


def _allreduce_job(scale: float, *, add: float = 0.0) -> dict:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "value": scale * t.item() + add,
        "tensor": torch.full((2,), float(dist.get_rank())),
        "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
        "multicast": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST"),
        "threads": torch.get_num_threads(),
    }


def _torchrun_job(tag: str) -> tuple:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return tag, dist.get_rank(), dist.get_world_size(), str(dist.get_backend()), t.item()


def _raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("bad shard on purpose")
    dist.barrier()


def _hang_on_rank_1(pid_file: str) -> int:
    if dist.get_rank() == 1:
        # A grandchild too: clean-up must take the whole tree, not just the rank.
        sleeper = subprocess.Popen(["sleep", "600"])
        Path(pid_file).write_text(str(sleeper.pid))
        while True:
            time.sleep(0.1)
    return dist.get_rank()


def _sigkill_rank_1() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _return_unpicklable() -> object:
    return threading.Lock()


def _sleep_forever() -> None:
    while True:
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------
# Results


def test_results_come_back_in_rank_order_with_args_and_kwargs():
    results = sp_lab.launch(_allreduce_job, 10.0, add=1.0, world_size=2, backend="gloo", timeout=60)

    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 and r["backend"] == "gloo" for r in results)
    assert [r["value"] for r in results] == [31.0, 31.0]  # 10 * (1 + 2) + 1 on every rank
    assert torch.equal(results[1]["tensor"], torch.tensor([1.0, 1.0]))
    # NVLink multicast is kept off in every rank; CPU ranks split the cores between them.
    assert {(r["nvls"], r["multicast"]) for r in results} == {("0", "1")}
    expected_threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert {r["threads"] for r in results} == {expected_threads}


def _stderr_progress_then_warning() -> int:
    import warnings

    for i in range(3):  # a progress bar as tqdm and Hugging Face draw it: carriage returns, then a newline
        sys.stderr.write(f"\rLoading weights: {50 * i}%")
    sys.stderr.write("\n")
    sys.stderr.flush()
    warnings.warn("something to look at", UserWarning, stacklevel=1)
    sys.stderr.flush()
    return 0


def test_rank_stderr_is_red_only_for_problems(capsys):
    """A rank's progress bar arrives in the caller's stdout at its last state; its warning stays on stderr."""
    assert sp_lab.launch(_stderr_progress_then_warning, world_size=1, timeout=60) == [0]
    out, err = capsys.readouterr()
    assert "[rank 0] Loading weights: 100%\n" in out and "Loading weights" not in err
    assert "UserWarning: something to look at" in err and "warnings.warn" in err  # the warning with its source line
    assert "something to look at" not in out


def test_closures_and_lambdas_travel_by_value():
    offset = 100  # captured: the closure cannot be found by name in the workers

    def closure(x, transform):
        return transform(dist.get_rank()) + x + offset

    # A lambda as an argument, too.
    assert sp_lab.launch(closure, 1, lambda r: 10 * r, world_size=2, timeout=60) == [101, 111]


# ---------------------------------------------------------------------------------------------------
# Failures


def test_a_raising_rank_surfaces_its_rank_and_traceback():
    with pytest.raises(RankError) as info:
        sp_lab.launch(_raise_on_rank_1, world_size=2, timeout=60)
    error = info.value
    assert isinstance(error, RuntimeError)
    assert error.rank == 1
    assert "rank 1 raised ValueError: bad shard on purpose" in str(error)
    assert "_raise_on_rank_1" in error.traceback and "_raise_on_rank_1" in str(error)
    assert error.exitcode is None


def _count_then_raise(log: str) -> None:
    with open(log, "a") as file:
        file.write(f"rank {dist.get_rank()}\n")
    dist.barrier()  # both ranks have written before either raises (the caller kills the rest at the first failure)
    raise ValueError("fails after the group formed")


def _ranks_joined_when_the_function_started() -> int:
    """How many ranks had formed the process group when this rank's function began: the count of torch's
    store-based barrier at the end of ``init_process_group``, read (adding 0) from the launch's rendezvous store,
    which the default group's store wraps."""
    c10d = dist.distributed_c10d
    store = c10d._get_default_store().underlying_store
    return store.add(f"{c10d.STORE_BASED_BARRIER_PREFIX}:{dist.group.WORLD.group_name}", 0)


def test_no_rank_runs_the_function_before_every_rank_has_formed_the_group():
    # A function with no collective: without the wait, rank 1 could finish and exit while rank 0's gloo mesh was
    # still reading the handshake, and rank 0 failed with "Connection closed by peer" (6 busy loops on 2 cores:
    # 8 restarts and 2 failed launches in 240).
    results = sp_lab.launch(_ranks_joined_when_the_function_started, world_size=2, backend="gloo", timeout=120)
    assert results == [2, 2]


def test_a_failure_of_the_function_is_raised_without_starting_the_ranks_again(tmp_path, capfd):
    log = tmp_path / "calls"
    with pytest.raises(RankError) as info:
        sp_lab.launch(_count_then_raise, str(log), world_size=2, backend="gloo", timeout=60)
    assert not info.value.during_rendezvous
    assert sorted(log.read_text().splitlines()) == ["rank 0", "rank 1"], "the function ran more than once per rank"
    assert "starting them again" not in capfd.readouterr().err


def test_ranks_that_cannot_form_their_group_are_started_once_more_then_the_error_is_raised(monkeypatch, capfd):
    # A real failure while forming the gloo group, on every rank: no network interface of that name.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(RankError) as info:
        sp_lab.launch(_allreduce_job, 1.0, world_size=2, backend="gloo", timeout=120)
    assert info.value.during_rendezvous
    assert "nosuchif0" in str(info.value)
    assert capfd.readouterr().err.count("could not form their process group") == 1


def test_a_second_start_after_a_failed_rendezvous_returns_the_results(monkeypatch, capfd):
    from sp_lab.distributed import launch as launch_module

    real, starts = launch_module._run_ranks, []

    def first_start_fails_to_form_the_group(*args):
        starts.append(args)
        if len(starts) == 1:
            raise RankError("rank 1 raised RuntimeError: Gloo connectFullMesh failed", rank=1, during_rendezvous=True)
        return real(*args)

    monkeypatch.setattr(launch_module, "_run_ranks", first_start_fails_to_form_the_group)
    results = sp_lab.launch(_allreduce_job, 2.0, world_size=2, backend="gloo", timeout=120)
    assert len(starts) == 2
    assert [(r["rank"], r["value"]) for r in results] == [(0, 6.0), (1, 6.0)]  # 2 * (1 + 2): a real group
    assert capfd.readouterr().err.count("could not form their process group (rank 1 raised RuntimeError") == 1


def test_the_rank_that_failed_first_is_named_whatever_order_the_reports_arrive_in():
    from types import SimpleNamespace

    from sp_lab.distributed.launch import _root_cause_first

    peer_error = SimpleNamespace(rank=0, report=("error", "RuntimeError", "Connection closed by peer", "tb", "run", 20.0))
    cause = SimpleNamespace(rank=1, report=("error", "OSError", "No space left on device", "tb", "run", 10.0))
    died = SimpleNamespace(rank=1, report=("died", -9))
    assert [w.rank for w in _root_cause_first([peer_error, cause])] == [1, 0]
    assert [w.report[0] for w in _root_cause_first([peer_error, died])] == ["died", "error"]


def test_a_second_failure_without_a_message_is_listed_too():
    """A bare ``assert`` in a rank has no text: the summary of the other failures must still be built."""
    from types import SimpleNamespace

    from sp_lab.distributed.launch import _one_line

    silent = SimpleNamespace(rank=1, report=("error", "AssertionError", "", "tb", "run", 1.0))
    assert _one_line(silent) == "rank 1 raised AssertionError: "


def test_arguments_the_function_cannot_take_are_refused_before_any_rank_starts():
    with pytest.raises(TypeError, match=r"_raise_on_rank_1\(\) cannot take the arguments given"):
        sp_lab.launch(_raise_on_rank_1, 1, world_size=2)


def test_a_sigkilled_rank_is_named_with_its_signal():
    with pytest.raises(RankError) as info:
        sp_lab.launch(_sigkill_rank_1, world_size=2, timeout=60)
    error = info.value
    assert error.rank == 1
    assert error.exitcode == -signal.SIGKILL
    assert error.signal == signal.SIGKILL
    assert "rank 1" in str(error) and "SIGKILL" in str(error)


def test_a_hung_rank_times_out_and_its_process_tree_is_killed(tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    timeout = 10.0
    started = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        sp_lab.launch(_hang_on_rank_1, str(pid_file), world_size=2, timeout=timeout)
    elapsed = time.monotonic() - started

    error = info.value
    assert isinstance(error, TimeoutError) and isinstance(error, RuntimeError)
    assert 1 in error.ranks and error.timeout == timeout
    assert "rank(s) 1" in str(error) and "10 s" in str(error)
    assert "_hang_on_rank_1" in error.stacks[1]  # where it was stuck, from faulthandler
    # Deadline, stack dump (~1 s) and SIGTERM grace (<= 3 s) at most.
    assert timeout <= elapsed < timeout + 6.0
    sleeper = int(pid_file.read_text())
    deadline = time.monotonic() + 2.0
    while _is_alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _is_alive(sleeper), "the hung rank's child process survived clean-up"


def test_an_unpicklable_result_is_reported_as_such():
    with pytest.raises(RankError, match="must be picklable"):
        sp_lab.launch(_return_unpicklable, world_size=1, timeout=60)


def test_ctrl_c_in_the_caller_kills_the_workers(ctrl_c_raises):
    # A real SIGINT, as a notebook's "interrupt kernel" sends, once the workers are up.
    timer = threading.Timer(4.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            sp_lab.launch(_sleep_forever, world_size=2, timeout=60)
    finally:
        timer.cancel()
    # no_leftover_processes checks that the workers are gone.


_CALLER_SCRIPT = """
import os, time, sp_lab

def report_pid_then_sleep():
    print("pid", os.getpid(), flush=True)
    while True:
        time.sleep(0.1)

sp_lab.launch(report_pid_then_sleep, world_size=2, timeout=120)
"""


def test_workers_die_with_a_killed_caller(tmp_path):
    # A notebook kernel killed outright runs no clean-up: the lifeline pipe must take the ranks down, and they
    # remove the launch's temporary directory (the pickled job) that the caller could not.
    env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(tmp_path))
    caller = subprocess.Popen(
        [sys.executable, "-c", _CALLER_SCRIPT], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        pids = []
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            line = caller.stdout.readline()  # "[rank N] pid P", forwarded by the caller
            if not line:
                break
            if " pid " in line:
                pids.append(int(line.split()[-1]))
        assert len(pids) == 2, "the ranks never reported their pids"
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 5.0
        while any(map(_is_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_is_alive, pids)), "ranks outlived their SIGKILLed caller"
        left = list(tmp_path.glob("sp_lab_launch_*"))
        assert not left, f"the launch's temporary directory outlived its SIGKILLed caller: {left}"
    finally:
        caller.kill()
        caller.wait()
        caller.stdout.close()


# ---------------------------------------------------------------------------------------------------
# Bad input: rejected before any process starts


def test_nccl_with_more_ranks_than_gpus_names_the_counts():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=rf"world_size={gpus + 1} .*needs one GPU per rank.* {gpus} GPU"):
        sp_lab.launch(print, world_size=gpus + 1, backend="nccl")


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"backend='bogus' is not known .*'gloo'.*'nccl'"):
        sp_lab.launch(print, backend="bogus")
    with pytest.raises(ValueError, match="fake_process_group"):
        resolve_backend("fake", 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "world_size must be a positive int"),
        ({"timeout": -1}, "timeout must be a positive number"),
        ({"world_size": 2, "file": threading.Lock()}, "could not serialise"),  # print takes file=
    ],
)
def test_bad_arguments_are_rejected_up_front(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        sp_lab.launch(print, **kwargs)


def test_auto_picks_gloo_without_gpus():
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs; 'auto' would pick NCCL")
    assert resolve_backend("auto", 2) == "gloo"


# ---------------------------------------------------------------------------------------------------
# The same function under torchrun


def test_the_same_function_runs_under_torchrun(tmp_path):
    # TMPDIR: torchrun leaves its log directory (torchelastic_*) behind; here it goes with the test's.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), TMPDIR=str(tmp_path))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "sp_lab.distributed.launch", "test_launch:_torchrun_job", "hello",
    ]  # fmt: skip
    done = subprocess.run(
        command, check=False, env=env, capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(re.findall(r"rank \d: \(.*?\)", done.stdout))
    assert lines == ["rank 0: ('hello', 0, 2, 'gloo', 3.0)", "rank 1: ('hello', 1, 2, 'gloo', 3.0)"]
