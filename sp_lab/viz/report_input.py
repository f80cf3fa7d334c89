"""How the explorer reads a CompileReport: the compiler's own typed records, through its one strict loader.

Every view in ``sp_lab.viz`` takes a report as a path (``.json.gz`` too), its dict, or the compiler's
:class:`~sp_lab.compiler.report.CompileReport`, and reads it through :func:`as_report` and nothing else: the
records are the contract (``sp_lab.compiler.report`` imports no torch), so a report saved on a GPU box can be
explored on a laptop with no compiler run and no GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sp_lab.compiler.report import CompileReport, RangeReport

if TYPE_CHECKING:
    from typing import TypeAlias

    ReportSource: TypeAlias = CompileReport | Mapping[str, Any] | str | Path
    """What every view accepts: the compiler's report, its dict, or a path to its JSON."""

__all__ = ["as_report", "load_report", "range_label", "report_provenance", "resolve_range"]


def load_report(path: str | Path) -> CompileReport:
    """Read a CompileReport saved with ``report.to_json(path)`` (``.json.gz`` too) through the compiler's one strict
    loader (:meth:`CompileReport.load`: every field checked, older schemas migrated, errors name the file)."""
    return CompileReport.load(path)


def as_report(report: ReportSource) -> CompileReport:
    """The report as records, given a path to its JSON, its dict, or the compiler's object."""
    if isinstance(report, CompileReport):
        out = report
    elif isinstance(report, (str, Path)):
        out = load_report(report)
    elif isinstance(report, Mapping):
        out = CompileReport.from_dict(dict(report))
    else:
        raise TypeError(f"expected a CompileReport, its dict or a path to its JSON; got {type(report).__name__}")
    if not out.ranges:
        raise ValueError("report has no compile ranges ('ranges' is empty): nothing was compiled")
    return out


def report_provenance(report: CompileReport) -> str:
    """Where the report was compiled, in one line for a figure's title:
    ``"backend gloo · device cpu · torch 2.13.0"``.

    Under the fake process group (one process, placeholder collectives) it starts with "fake process group: graphs
    only": its graphs and shapes are the real ones, its compile times those of one process, no collective ran.
    """
    prov = report.provenance
    backend = prov.get("backend")
    parts = ["fake process group: graphs only" if backend == "fake" else f"backend {backend}" if backend else None,
             f"device {prov['device']}" if prov.get("device") else None,
             f"torch {prov['torch']}" if prov.get("torch") else None]
    return " · ".join(p for p in parts if p) or "provenance not recorded"


def range_label(rng: RangeReport) -> str:
    """``"tokens 8-64"``, or ``"tokens 8-64, 1-token graph"`` for an entry Dynamo specialised to one count."""
    special = f", {rng.static_tokens}-token graph" if rng.static_tokens is not None else ""
    return f"tokens {rng.lo}-{rng.hi}{special}"


def resolve_range(report: CompileReport, range_index: int | None) -> int:
    """The range to show. ``None`` picks where the story is: the first SP range that compiled or failed
    (ranges compile lazily, on their first token count), else the first with pieces, else range 0."""
    ranges = report.ranges
    if range_index is None:
        told = [i for i, r in enumerate(ranges) if r.pieces or r.failures]
        # A graph Dynamo specialised to one token count (N=1) is the odd one: prefer the symbolic one.
        told.sort(key=lambda i: (not ranges[i].enable_sp, ranges[i].static_tokens is not None, i))
        return told[0] if told else 0
    if not -len(ranges) <= range_index < len(ranges):
        available = ", ".join(f"{i}: {range_label(r)}" for i, r in enumerate(ranges))
        raise IndexError(f"range_index={range_index} is out of bounds; this report has {available}")
    return range_index % len(ranges)
