"""Process groups for sp_lab: the multi-rank launcher, torchrun entry, fake group and symmetric memory.

- :func:`sp_lab.launch` (defined in :mod:`sp_lab.distributed.launch`) runs a function on N ranks from a
  notebook cell. It is deliberately not re-exported here: a function named ``launch`` would hide the
  submodule of the same name.
- :func:`init_from_env` / :func:`run_under_torchrun` run the same function under torchrun.
- :mod:`sp_lab.distributed.collectives`: :func:`fake_process_group`, :func:`tp_group_name`,
  :func:`maybe_enable_symm_mem`, :func:`device_for_rank`, :func:`rehearse_on_one_gpu` (N ranks on one GPU).
"""

from importlib import import_module

from sp_lab.distributed.collectives import (
    device_for_rank,
    fake_process_group,
    maybe_enable_symm_mem,
    rehearsal_device,
    rehearse_on_one_gpu,
    tp_group_name,
)

# Resolved on first use, so that `python -m sp_lab.distributed.launch` (torchrun's entry) does not find
# its own module imported already by this package (runpy warns about exactly that).
_FROM_LAUNCH = (
    "LaunchError",
    "LaunchTimeout",
    "RankError",
    "RankInfo",
    "init_from_env",
    "resolve_backend",
    "run_under_torchrun",
)

__all__ = [
    "LaunchError",
    "LaunchTimeout",
    "RankError",
    "RankInfo",
    "device_for_rank",
    "fake_process_group",
    "init_from_env",
    "maybe_enable_symm_mem",
    "rehearsal_device",
    "rehearse_on_one_gpu",
    "resolve_backend",
    "run_under_torchrun",
    "tp_group_name",
]


def __getattr__(name: str):
    if name in _FROM_LAUNCH:
        return getattr(import_module("sp_lab.distributed.launch"), name)
    raise AttributeError(f"module 'sp_lab.distributed' has no attribute {name!r}")
