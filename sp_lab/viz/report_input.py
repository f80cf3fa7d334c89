"""How the explorer reads a CompileReport: from a path, a dict or the compiler's object, as read-only records.

Every view in ``sp_lab.viz`` reads a report through :func:`as_report` and nothing else, with attribute access
(``rng.lo``, ``piece.graph_after.nodes``, ``tensor.bytes_per_token_after``), so a saved report can be explored on
a laptop with no compiler, no GPU and no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from sp_lab.compiler.report import CompileReport

if TYPE_CHECKING:
    from typing import TypeAlias

    ReportSource: TypeAlias = CompileReport | Mapping[str, Any] | str | Path | SimpleNamespace
    """What every view accepts: the compiler's report, its dict, a path to its JSON, or as_report's result."""

__all__ = ["SCHEMA_PREFIX", "as_report", "load_report", "resolve_range", "to_plain"]

SCHEMA_PREFIX = "sp_lab.compile_report/"

# Fields that hold a free-form mapping (op name -> count, config key -> value): kept as dicts, not records.
_MAPPING_FIELDS = frozenset({"matches", "op_counts_before", "op_counts_after", "requested", "effective",
                             "provenance", "model"})


def _record(value: Any, key: str | None = None) -> Any:
    if isinstance(value, Mapping):
        if key in _MAPPING_FIELDS:
            return dict(value)
        return SimpleNamespace(**{k: _record(v, k) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_record(v) for v in value)
    return value


def load_report(path: str | Path) -> SimpleNamespace:
    """Read a CompileReport saved as JSON (``report.to_json(path)``; ``.json.gz`` too) through the compiler's
    one strict loader (:meth:`CompileReport.load`: every field checked, older schemas migrated)."""
    return as_report(CompileReport.load(path))


def as_report(report: ReportSource) -> SimpleNamespace:
    """The report as read-only records, given a path to its JSON, its dict, or an object with ``to_dict()``."""
    if isinstance(report, SimpleNamespace) and hasattr(report, "ranges"):
        return report
    if isinstance(report, (str, Path)):
        return load_report(report)
    if hasattr(report, "to_dict"):
        report = report.to_dict()
    if not isinstance(report, Mapping):
        raise TypeError(f"expected a CompileReport, its dict or a path to its JSON; got {type(report).__name__}")
    schema = str(report.get("schema", ""))
    if not schema.startswith(SCHEMA_PREFIX):
        raise ValueError(f"report schema {schema!r} is not {SCHEMA_PREFIX}*; this explorer reads reports "
                         f"written by sp_lab's CompileReport.to_dict()")
    if not report.get("ranges"):
        raise ValueError("report has no compile ranges ('ranges' is empty): nothing was compiled")
    return _record(report)


def resolve_range(report: SimpleNamespace, range_index: int | None) -> int:
    """The range to show. ``None`` picks where the story is: the first SP range that compiled or failed
    (ranges compile lazily, on their first token count), else the first with pieces, else range 0."""
    ranges = report.ranges
    if range_index is None:
        told = [i for i, r in enumerate(ranges) if r.pieces or r.failures]
        return next((i for i in told if ranges[i].enable_sp), told[0] if told else 0)
    if not -len(ranges) <= range_index < len(ranges):
        available = ", ".join(f"{i}: tokens {r.lo}-{r.hi}" for i, r in enumerate(ranges))
        raise IndexError(f"range_index={range_index} is out of bounds; this report has {available}")
    return range_index % len(ranges)


def to_plain(report: ReportSource) -> dict:
    """The report as plain JSON-able data again (for torch's structured trace)."""
    def plain(value: Any) -> Any:
        if isinstance(value, SimpleNamespace):
            return {k: plain(v) for k, v in vars(value).items()}
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return plain(as_report(report))
