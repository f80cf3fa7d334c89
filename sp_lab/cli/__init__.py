"""Headless command line: ``python -m sp_lab <command>`` (also installed as ``sp-lab``).

One module per command (``python -m sp_lab COMMAND --help`` prints its module's docstring):

``run``     the whole job on one machine: sweep, tune, measure the tuned config, export, report (:mod:`.run`).
``sweep``   measure latency rows into a store (:mod:`.sweep`).
``tune``    recommend a policy from measured rows (:mod:`.tune`).
``export``  write the tuned config file (:mod:`.export`).
``report``  an HTML report of the rows (:mod:`.report`).
``replay``  import recorded rows as ``source="replayed"`` (:mod:`.replay`).
``predict`` the performance model for GPUs that are not here, or ``--validate`` (:mod:`.predict`).

Shared pieces: :mod:`.arguments` (argument types and option groups), :mod:`.rows` (reading and choosing rows),
:mod:`.ranks` (spawned ranks or torchrun), :mod:`.errors` (:class:`CliError`), :mod:`.dispatch` (the parser and
``main``). Every command reads and writes the same default store (``out/sweeps`` in the project: see
:mod:`sp_lab.paths`; the notebooks and the tuner use the same) and says which one it used. The work is done in
the library (:mod:`sp_lab.bench`, :mod:`sp_lab.tuning`, :mod:`sp_lab.viz`); the commands only parse arguments and
call it. Everything heavy (torch, polars, plotly) is imported inside the command that needs it, so
``python -m sp_lab --help`` answers at once.
"""

from sp_lab.cli.dispatch import COMMANDS, build_parser, main
from sp_lab.cli.errors import CliError

__all__ = ["COMMANDS", "CliError", "build_parser", "main"]
