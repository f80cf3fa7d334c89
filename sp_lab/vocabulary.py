"""The words sp_lab's rows, plots, files and commands share: variants, sources, provenance columns.

Every module that writes or reads a sweep row spells these names from here, so a plot's legend, the
store's rows, the tuner's table and the exported file can never disagree about what a variant or a
source is called. This module imports nothing (it sits below every other layer).
"""

from __future__ import annotations

# --------------------------------------------------------------------------------------------- variants
BASELINE = "baseline"
"""Plain tensor parallelism: an ``all_reduce`` after each row-parallel matmul (SP and AsyncTP off)."""
SP = "sp"
"""Sequence parallelism alone: ``reduce_scatter`` / ``all_gather`` around the norms, no fused kernels."""
SP_ASYNC_TP = "sp+async_tp"
"""SP with AsyncTP: the collectives fused with their neighbouring matmuls."""
TUNED = "tuned"
"""The given (tuned) config as is: whatever its gates choose at each token count."""
FUSION_MISSING_SUFFIX = " [fusion missing]"
"""Appended to a variant whose transformation did not run (its fusion did not fire): the store's
``reported_variant``, legends and the report spell such a row ``"<variant> [fusion missing]"``."""

# Which passes each variant runs, and the variants' order, are sp_lab.programs.PROGRAMS (one table).

# ---------------------------------------------------------------------------------------------- sources
MEASURED = "measured"
"""Timed here, on the devices the row names."""
PREDICTED = "predicted"
"""Predicted by the performance model (``sp_lab.tuning.predict``, the one model sp_lab has) for GPUs that are
not here: measured single-GPU kernel times plus a published-bandwidth communication model; no distributed run
happened. The CLI's curves, the tuner's overlay and its demo replay, the report's section and the rule-training
fixture all carry this one name."""
SIMULATED = "simulated"
"""Rows an older sp_lab's what-if model wrote into stores (retired: nothing makes them now). Read back under
their own name, never as ``predicted``: the current model did not compute them."""
REHEARSAL = "rehearsal"
"""Several ranks on one GPU: the code path of a multi-GPU run, but not its latency."""
REPLAYED = "replayed"
"""Recorded elsewhere (another machine or an earlier store) and imported."""

SOURCES = (MEASURED, PREDICTED, SIMULATED, REHEARSAL, REPLAYED)
"""Where a row's numbers come from; rows of different sources are never compared unlabelled."""
MODELLED_SOURCES = (PREDICTED, SIMULATED)
"""Rows a model computed rather than timed: never relabelled as ``replayed`` when imported."""
TUNABLE_SOURCES = (MEASURED, REPLAYED)
"""Sources a threshold is tuned on unless another is named (in this order of preference)."""

NEVER = "never"
"""The one spelling of "no token count gets the rewrite" (threshold ``None`` in code)."""
ALWAYS = "always"
"""The policy that rewrites at every token count: with :data:`NEVER`, the closest choices a release without a token
gate can run (:func:`sp_lab.programs.closest_policy`)."""

# ------------------------------------------------------------------------------------------ provenance
SETUP_COLUMNS = ("model", "hidden_size", "num_layers", "tp", "dtype", "device_name", "backend", "boundary",
                 "torch_version")
"""Columns that must agree for rows to be tuned together (one curve per variant); with the compile settings the
variants share, a setup (:class:`sp_lab.bench.setups.Setup`, the one definition readers choose by). Another torch
compiles other kernels: its rows are another setup, and the resume key (``KEY_COLUMNS``) measures them anew."""
PROVENANCE_COLUMNS = (
    "source",
    *SETUP_COLUMNS,
    "device_count",
    "sp_lab_version",
    "hostname",
    "timing_method",
)
"""Where a number comes from: what the report's provenance table and an exported file carry."""
LEGEND_COLUMNS = ("model", "device_name", "tp", "torch_version", "boundary", "dtype")
"""Provenance columns that, when they differ between rows, must show in every plot label."""

# ----------------------------------------------------------------------------------------- file layout
DEFAULT_OUT = "out"
"""Where ``python -m sp_lab run`` writes (store, configs, report), relative to the working directory."""
DEFAULT_STORE = f"{DEFAULT_OUT}/sweeps"
"""The sweep store every command and the tuner widget read and write unless told otherwise."""
DEFAULT_REPORT = f"{DEFAULT_OUT}/report.html"
"""The HTML report's default path."""


def describe_threshold(threshold: int | None) -> str:
    """``"never"`` for ``None``, else the number: how a threshold is printed everywhere."""
    return NEVER if threshold is None else str(int(threshold))
