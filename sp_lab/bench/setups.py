"""What makes sweep rows comparable (a *setup*), and which setup a reader shows when a store holds several.

A store collects rows of many setups: ``make run`` sweeps the float32 toy with 2 layers, notebook 06 the bf16 and
FP8 toy with 1 layer, another machine's rows arrive by replay. Rows of two setups never share a curve, a regret or
a recommendation: a 1-layer bf16 latency says nothing about where the 2-layer float32 model crosses over. This
module is the one definition of a setup (:class:`Setup`) and of the choice every reader makes (the tuner, its
replay, the HTML report, the command line): :func:`select_setup` keeps the rows of the setup asked for, else of the
newest one, and says which it kept and what else the rows hold (:class:`SetupChoice`).

A setup is the row columns :data:`~sp_lab.vocabulary.SETUP_COLUMNS` (model and its sizes, dtype or FP8 scheme, tp,
device, backend, boundary, torch) plus the compile settings the variants of a sweep share: the row's
``config_json`` without the fields a variant sets itself (its SP/AsyncTP gates and per-matmul rule) and those
that have a column of their own, written as its differences from :class:`~sp_lab.config.LabConfig`'s defaults
(``"defaults"``, ``"max_num_tokens=512"``).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Literal

import polars as pl

from sp_lab.vocabulary import SETUP_COLUMNS

SETTINGS = "settings"
"""The setup field derived from ``config_json`` (see the module docstring)."""
SETUP_FIELDS = (*SETUP_COLUMNS, SETTINGS)
"""The fields of a :class:`Setup`, in order: what a setup can be asked by (``select_setup(rows, {"dtype": ...})``)."""

# LabConfig fields that differ between the variants of one sweep (programs.variant_config / Policy.to_config set
# them) or that are setup columns of their own: not part of the shared compile settings.
_PER_VARIANT_FIELDS = frozenset({"enable_sp", "enable_async_tp", "async_tp_min_tokens", "sp_min_tokens", "heuristic",
                                 "heuristic_default", "tp_size", "boundary"})
_NO_CONFIG = "not recorded"
"""The settings of rows without a ``config_json`` column (a predicted demo, hand-made rows)."""
DEFAULT_SETTINGS = "defaults"
"""The settings of rows swept with LabConfig's defaults (apart from the gates each variant sets)."""

HowChosen = Literal["only", "asked", "newest"]
AskStyle = Literal["python", "cli"]


class SetupNotFoundError(ValueError):
    """No row of the setup asked for; the message lists the setups the rows hold and how to ask for each."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """The provenance rows must share to be drawn, scored or tuned together (``None``: the rows lack the column)."""

    model: str | None
    hidden_size: int | None
    num_layers: int | None
    tp: int | None
    dtype: str | None
    """The model dtype, or its FP8 scheme (``"fp8-rowwise"``): an FP8 sweep is a setup of its own."""
    device_name: str | None
    backend: str | None
    boundary: str | None
    torch_version: str | None
    settings: str | None
    """The compile settings the variants share, as differences from LabConfig's defaults (``"defaults"``)."""

    def to_dict(self) -> dict[str, object]:
        """The fields by name, in :data:`SETUP_FIELDS` order."""
        return {f: getattr(self, f) for f in SETUP_FIELDS}

    def describe(self) -> str:
        """One line naming every field: ``"toy (2 layers, hidden 64), float32, tp 2, cpu: ..., gloo, sharded,
        torch 2.13.0, compile settings: defaults"``."""
        layers = "layer" if self.num_layers == 1 else "layers"
        return (f"{self.model} ({self.num_layers} {layers}, hidden {self.hidden_size}), {self.dtype}, tp {self.tp}, "
                f"{self.device_name}, {self.backend}, {self.boundary}, torch {self.torch_version}, "
                f"compile settings: {self.settings}")

    def matches(self, asked: Mapping[str, object]) -> bool:
        """Whether every field named in ``asked`` has that value (compared as text: ``tp=2`` and ``"2"`` alike)."""
        return all(str(getattr(self, field)) == str(value) for field, value in asked.items())


@dataclasses.dataclass(frozen=True)
class SetupRows:
    """A setup as some rows hold it: how many rows, of which sources, the newest when."""

    setup: Setup
    rows: int
    newest: str | None
    """The newest row's ``timestamp`` (UTC ISO-8601; ``None`` when the rows carry none)."""
    sources: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SetupChoice:
    """Which setup :func:`select_setup` kept, why, and the setups it left out (newest first)."""

    chosen: SetupRows
    others: tuple[SetupRows, ...]
    how: HowChosen
    """``"only"``: the rows hold one setup; ``"asked"``: the one asked for (the newest of those matching);
    ``"newest"``: nothing was asked and the rows hold several."""
    asked: Mapping[str, object] | None = None

    @property
    def setup(self) -> Setup:
        """The chosen setup."""
        return self.chosen.setup

    def message(self, style: AskStyle = "python") -> str:
        """What was chosen and what else is there, with how to ask for each other setup (``style``: as a Python
        argument ``setup={...}`` or as the command line's ``--setup k=v,...``)."""
        chosen = f"{self.chosen.setup.describe()} ({_rows_when(self.chosen)})"
        if not self.others:
            return f"setup: {chosen}"
        if self.how == "asked" and set(self.asked or {}) >= set(SETUP_FIELDS):  # a whole Setup: it is named below
            head = f"setup asked for: {chosen}"
        elif self.how == "asked":
            head = f"setup asked for ({_format_query(self.asked or {}, style)}): {chosen}"
        else:
            head = f"setup: the newest of {1 + len(self.others)} in these rows, {chosen}"
        varying = _varying_fields([self.chosen, *self.others])
        listing = "\n".join(f"  - {_format_query(_query(o.setup, varying), style)}: {_rows_when(o)}"
                            for o in self.others)
        return f"{head}\nother setups, never mixed with it (ask for one by its fields):\n{listing}"


def describe_timestamp(timestamp: str | None) -> str:
    """A row's ``timestamp`` as people read it: ``"2026-12-06 22:10 UTC"`` (``"unknown time"`` for none)."""
    if not timestamp:
        return "unknown time"
    try:
        when = _dt.datetime.fromisoformat(str(timestamp))
    except ValueError:
        return str(timestamp)
    if when.tzinfo is not None:
        when = when.astimezone(_dt.UTC)
    return when.strftime("%Y-%m-%d %H:%M UTC")


def with_setup_columns(rows: pl.DataFrame) -> pl.DataFrame:
    """``rows`` with every :data:`SETUP_FIELDS` column: ``settings`` derived from ``config_json``, a column the
    rows lack as nulls (so rows of any origin group alike)."""
    missing = [c for c in SETUP_COLUMNS if c not in rows.columns]
    rows = rows.with_columns(pl.lit(None).alias(c) for c in missing)
    if "config_json" in rows.columns:
        settings = {t: compile_settings(t) for t in rows["config_json"].unique().to_list() if t is not None}
        return rows.with_columns(pl.col("config_json").replace_strict(settings, return_dtype=pl.String,
                                                                      default=_NO_CONFIG).alias(SETTINGS))
    return rows.with_columns(pl.lit(_NO_CONFIG).alias(SETTINGS))


def compile_settings(config_json: str | None) -> str:
    """A row's compile settings shared by the variants of its sweep (see the module docstring)."""
    if not config_json:
        return _NO_CONFIG
    try:
        doc = json.loads(config_json)
    except ValueError:
        return f"unreadable config_json {config_json[:40]!r}"
    fields = doc.get("sp_lab", doc) if isinstance(doc, dict) else {}
    defaults = _default_fields()
    differs = [f"{k}={_short(v)}" for k, v in sorted(fields.items())
               if k not in _PER_VARIANT_FIELDS and (k not in defaults or defaults[k] != v)]
    return ", ".join(differs) or DEFAULT_SETTINGS


@functools.cache
def _default_fields() -> dict[str, object]:
    from sp_lab.config import LabConfig

    return json.loads(json.dumps(LabConfig().to_dict()))  # as a row's JSON holds them (lists, not tuples)


def _short(value: object) -> str:
    return json.dumps(value, separators=(",", ":")) if isinstance(value, (list, dict)) else str(value)


def setup_of_row(row: Mapping[str, object]) -> Setup:
    """The setup of one row (a dict of row columns; ``config_json`` gives the compile settings): what a sweep
    says of the rows it writes (:attr:`sp_lab.bench.sweep.SweepResult.setup`)."""
    values = {c: row.get(c) for c in SETUP_COLUMNS}
    values = {c: str(v) if isinstance(v, str) else v for c, v in values.items()}  # a StrEnum as its text
    return Setup(**values, settings=compile_settings(row.get("config_json")))  # type: ignore[arg-type]


def setups(rows: pl.DataFrame) -> list[SetupRows]:
    """The setups ``rows`` hold, newest first (by each one's newest ``timestamp``; then most rows), with row counts."""
    if not rows.height:
        return []
    frame = with_setup_columns(rows)
    has_time = "timestamp" in frame.columns
    has_source = "source" in frame.columns
    aggs = [pl.len().alias("_rows"),
            (pl.col("timestamp").max() if has_time else pl.lit(None, dtype=pl.String)).alias("_newest"),
            (pl.col("source").unique().sort() if has_source else pl.lit([], dtype=pl.List(pl.String))).alias("_src")]
    groups = frame.group_by(list(SETUP_FIELDS)).agg(aggs)
    found = []
    for g in groups.iter_rows(named=True):
        setup = Setup(**{f: g[f] for f in SETUP_FIELDS})
        found.append(SetupRows(setup=setup, rows=int(g["_rows"]), newest=g["_newest"],
                               sources=tuple(s for s in g["_src"] or () if s is not None)))
    # The newest first; rows without a time last; then the bigger one; then by text, so the order never wobbles.
    found.sort(key=lambda s: (s.newest or "", s.rows, s.setup.describe()), reverse=True)
    found.sort(key=lambda s: s.newest is None)
    return found


def check_query(asked: Mapping[str, object]) -> dict[str, object]:
    """``asked`` as a setup query, its field names checked (an unknown one is refused naming the known ones)."""
    unknown = sorted(set(asked) - set(SETUP_FIELDS))
    if unknown:
        raise ValueError(f"setup fields {unknown} do not exist; a setup is asked for by {list(SETUP_FIELDS)}")
    return dict(asked)


def parse_query(text: str) -> dict[str, str]:
    """``"dtype=bfloat16,num_layers=1"`` (the command line's ``--setup``) as a setup query."""
    query = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        field, sep, value = part.partition("=")
        if not sep or not field.strip():
            raise ValueError(f"setup {text!r}: expected FIELD=VALUE[,FIELD=VALUE...], e.g. dtype=bfloat16,num_layers=1;"
                             f" fields: {', '.join(SETUP_FIELDS)}")
        query[field.strip()] = value.strip()
    return check_query(query)


def select_setup(rows: pl.DataFrame, asked: Setup | Mapping[str, object] | None = None, *,
                 style: AskStyle = "python") -> tuple[pl.DataFrame, SetupChoice]:
    """The rows of one setup and the :class:`SetupChoice` saying which and what else is there.

    ``asked``: a :class:`Setup`, or some of its fields (``{"dtype": "bfloat16", "num_layers": 1}``): the newest
    setup that has them. ``None``: the newest setup of the rows. Rows of one setup come back whole.
    Raises :class:`SetupNotFoundError` when no row has the fields asked for (the message lists the setups there,
    spelled for ``style``), ``ValueError`` for no rows or a field that does not exist.
    """
    if not rows.height:
        raise ValueError("no rows: nothing to choose a setup from (run a sweep first)")
    query = None if asked is None else check_query(asked.to_dict() if isinstance(asked, Setup) else asked)
    found = setups(rows)
    matching = found if query is None else [s for s in found if s.setup.matches(query)]
    if not matching:
        varying = _varying_fields(found)
        listing = "\n".join(f"  - {_format_query(_query(s.setup, varying or list(query)), style)}: {_rows_when(s)}"
                            for s in found)
        raise SetupNotFoundError(f"no rows of the setup asked for ({_format_query(query, style)}); the rows hold "
                                 f"{len(found)} setup(s):\n{listing}")
    chosen = matching[0]
    how: HowChosen = "only" if len(found) == 1 else "newest" if query is None else "asked"
    choice = SetupChoice(chosen=chosen, others=tuple(s for s in found if s is not chosen), how=how, asked=query)
    if len(found) == 1:
        return rows, choice
    keep = with_setup_columns(rows).select(
        pl.all_horizontal(_same(f, getattr(chosen.setup, f)) for f in SETUP_FIELDS).alias("_keep"))["_keep"]
    return rows.filter(keep), choice


def one_setup(rows: pl.DataFrame, what: str) -> None:
    """Refuse rows of several setups for ``what`` (e.g. "a policy"), naming them: the guard of the readers that
    take rows already chosen (:func:`select_setup` chooses)."""
    found = setups(rows)
    if len(found) > 1:
        varying = _varying_fields(found)
        listing = "; ".join(f"{_format_query(_query(s.setup, varying), 'python')} ({s.rows} rows)" for s in found)
        raise ValueError(f"rows of {len(found)} setups ({listing}): {what} is made for one setup; choose one with "
                         "sp_lab.bench.setups.select_setup(rows, {...})")


def _same(field: str, value: object) -> pl.Expr:
    col = pl.col(field)
    return col.is_null() if value is None else (col == value).fill_null(False)


def _varying_fields(found: Sequence[SetupRows]) -> list[str]:
    """The fields on which ``found`` differ: enough to tell each from the others."""
    return [f for f in SETUP_FIELDS if len({str(getattr(s.setup, f)) for s in found}) > 1]


def _query(setup: Setup, fields: Sequence[str]) -> dict[str, object]:
    return {f: getattr(setup, f) for f in fields}


def _format_query(query: Mapping[str, object], style: AskStyle) -> str:
    if style == "cli":
        return "--setup " + ",".join(f"{k}={v}" for k, v in query.items())
    return "setup={" + ", ".join(f"{k!r}: {v!r}" for k, v in query.items()) + "}"


def _rows_when(s: SetupRows) -> str:
    sources = f", {'/'.join(s.sources)}" if s.sources else ""
    newest = f", newest {describe_timestamp(s.newest)}" if s.newest else ""
    return f"{s.rows} rows{sources}{newest}"


__all__ = ["DEFAULT_SETTINGS", "SETUP_FIELDS", "Setup", "SetupChoice", "SetupNotFoundError", "SetupRows",
           "check_query", "compile_settings", "describe_timestamp", "one_setup", "parse_query", "select_setup",
           "setup_of_row", "setups", "with_setup_columns"]
