"""A tuned config written to disk with what it was chosen from: one file per device / tp / model / dtype.

The file's provenance carries the policy, its regret from :func:`sp_lab.tuning.regret.regret_table` (the
same table the tuner and the report show), the recommendation with its confidence when there is one, and
:func:`data_hash` of the rows: the one hash of "which rows was this decided on".
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from sp_lab.tuning.policy import Policy
from sp_lab.tuning.regret import regret_table, summarize
from sp_lab.vocabulary import NEVER, PREDICTED

if TYPE_CHECKING:
    from sp_lab.config import LabConfig
    from sp_lab.tuning.policy import Recommendation


def data_hash(rows: pl.DataFrame) -> str:
    """16 hex digits naming a set of rows: their sorted ``row_id``s, or their content where rows have none."""
    if "row_id" in rows.columns and rows["row_id"].null_count() == 0:
        text = "\n".join(sorted(rows["row_id"].to_list()))
    else:
        text = "\n".join(sorted(map(str, rows.select(sorted(rows.columns)).iter_rows())))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def threshold_text(config: LabConfig) -> str:
    """``async_tp_min_tokens`` as a person reads it: the number, or "never" when SP and AsyncTP are off."""
    return str(config.async_tp_min_tokens) if config.enable_sp and config.enable_async_tp else NEVER


def provenance(rows: pl.DataFrame, config: LabConfig, *, recommendation: Recommendation | None = None,
               chosen_in: str) -> dict[str, Any]:
    """What an exported file says about how ``config`` was chosen (beyond device, torch, data hash)."""
    row = rows.row(0, named=True)
    table = regret_table(rows, config, warn=False)
    total, worst = summarize(table)
    out: dict[str, Any] = {
        "source": row.get("source"),
        "sweep_rows": rows.height,
        "backend": row.get("backend"),
        "boundary": row.get("boundary"),
        "chosen_in": chosen_in,
        "policy": Policy.of(config).name,
        "async_tp_min_tokens": threshold_text(config),
        "regret": {"worst": worst, "total": total,
                   "per_token": {str(r["num_tokens"]): {"ran": r["variant_run"], "best": r["best_variant"],
                                                        "regret_rel": r["regret_rel"]}
                                 for r in table.iter_rows(named=True)}},
    }
    if recommendation is not None:
        out["recommendation"] = recommendation.to_dict()
    return out


def export_config(rows: pl.DataFrame, config: LabConfig, directory: str | Path, *,
                  recommendation: Recommendation | None = None, chosen_in: str,
                  vllm_release: str | None = None, allow_predicted: bool = False) -> Path:
    """Write ``config`` (tuned on ``rows`` of one setup) with its provenance; returns the file's path.

    Rows the performance model predicted (``source="predicted"``) are refused unless ``allow_predicted``:
    exporting a config no GPU has confirmed is an explicit choice, and the file then says ``source: predicted``.
    """
    from sp_lab.config import DEFAULT_VLLM_RELEASE, export_tuned_config

    if rows.height == 0:
        raise ValueError("no rows: run a sweep or replay recorded rows before exporting")
    if not allow_predicted and "source" in rows.columns and (rows["source"] == PREDICTED).any():
        raise ValueError("these rows are predictions (source='predicted'), not measurements; export them only on "
                         "purpose: allow_predicted=True (CLI: python -m sp_lab predict --export-predicted DIR)")
    row = rows.row(0, named=True)
    return export_tuned_config(
        config,
        directory=directory,
        device_name=str(row["device_name"]),
        model_spec={"name": str(row["model"]), "hidden_size": int(row["hidden_size"]),
                    "num_layers": int(row["num_layers"])},
        dtype=str(row["dtype"]),
        data_hash=data_hash(rows),
        extra_provenance=provenance(rows, config, recommendation=recommendation, chosen_in=chosen_in),
        vllm_release=vllm_release or DEFAULT_VLLM_RELEASE,
    )
