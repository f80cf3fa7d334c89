"""How far a sweep is, counting the points it reuses and where they come from.

A rerun of a sweep measures only the points its store lacks (:func:`sp_lab.bench.sweep.run_sweep` resumes). A
progress bar over the points measured now alone stops at "2 / 6" on a rerun that reused 4, and a reader cannot
tell a stuck sweep from a resumed one. :class:`SweepTally` is the one account every view gives (the sweep's own
tqdm bar, the launcher's bar, the tuner's bar and status line): all the sweep's points, how many came from which
earlier sweep, how many are measured now, how many a concurrent sweep measured:

    4 of 6 points from the sweep of 2026-12-06 22:10 UTC, 2 measured now
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import polars as pl

from sp_lab.bench.setups import describe_timestamp
from sp_lab.bench.store import KEY_COLUMNS


@dataclasses.dataclass(frozen=True)
class ReusedFrom:
    """Points a sweep takes from one earlier sweep of the store."""

    sweep_id: str
    newest: str | None
    """The ``timestamp`` of that sweep's newest reused row (UTC ISO-8601)."""
    points: int


@dataclasses.dataclass(frozen=True)
class SweepTally:
    """A sweep's points: all of them, reused (and from which sweeps), measured now, measured by another sweep."""

    total: int
    """Every (variant, token count) point of the sweep."""
    reused: int = 0
    """Points the store held already (not measured again)."""
    origins: tuple[ReusedFrom, ...] = ()
    """The earlier sweeps the reused points come from, oldest first."""
    measured: int = 0
    """Points measured by this sweep so far."""
    elsewhere: int = 0
    """Points a concurrent sweep of the same store claimed first and measured."""

    @property
    def to_measure(self) -> int:
        """Points this sweep measures itself (those neither reused nor taken by a concurrent sweep)."""
        return self.total - self.reused - self.elsewhere

    @property
    def done(self) -> int:
        """Points whose row is in the store, wherever it came from."""
        return self.reused + self.elsewhere + self.measured

    def describe(self) -> str:
        """``"4 of 6 points from the sweep of 2026-12-06 22:10 UTC, 2 measured now"`` (while measuring: ``"..., 1 of
        2 measured now"``)."""
        if not self.reused and not self.elsewhere:
            return f"{self.measured} of {self.total} points measured now"
        parts = [f"{self.reused} of {self.total} points from {self._origins()}"] if self.reused else []
        if self.elsewhere:
            parts.append(f"{self.elsewhere} of {self.total} measured by a concurrent sweep")
        if not self.to_measure:
            parts.append("none left to measure now")
        elif self.measured >= self.to_measure:
            parts.append(f"{self.measured} measured now")
        else:
            parts.append(f"{self.measured} of {self.to_measure} measured now")
        return ", ".join(parts)

    def _origins(self) -> str:
        if not self.origins:
            return "the store"
        times = sorted(o.newest for o in self.origins if o.newest)
        if len(self.origins) == 1:
            return f"the sweep of {describe_timestamp(times[0] if times else None)}"
        span = f" ({describe_timestamp(times[0])} to {describe_timestamp(times[-1])})" if times else ""
        return f"{len(self.origins)} earlier sweeps{span}"

    def with_measured(self, measured: int) -> SweepTally:
        """This tally with ``measured`` points measured now."""
        return dataclasses.replace(self, measured=measured)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the store's plan file carries it to a watcher in another process)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SweepTally:
        """Inverse of :meth:`to_dict`."""
        origins = tuple(ReusedFrom(**o) for o in d.get("origins", ()))
        return cls(**{**d, "origins": origins})


def tally_reuse(stored: pl.DataFrame, keys: Collection[tuple], total: int) -> SweepTally:
    """The tally of a sweep of ``total`` points about to start: which of its point ``keys`` (:data:`KEY_COLUMNS`
    tuples) ``stored`` (the store's rows of the sweep's source) holds already, by the sweep that measured them
    (a point measured twice counts for its newest row's sweep)."""
    if not stored.height or not keys:
        return SweepTally(total=total)
    wanted = pl.DataFrame([dict(zip(KEY_COLUMNS, k, strict=True)) for k in keys],
                          schema={c: stored.schema[c] for c in KEY_COLUMNS})
    found = (stored.join(wanted, on=list(KEY_COLUMNS), how="semi", nulls_equal=True)
             .sort("timestamp").group_by(list(KEY_COLUMNS)).last())
    if not found.height:
        return SweepTally(total=total)
    origins = (found.group_by("sweep_id").agg(newest=pl.col("timestamp").max(), points=pl.len())
               .sort("newest"))
    return SweepTally(total=total, reused=found.height,
                      origins=tuple(ReusedFrom(sweep_id=o["sweep_id"], newest=o["newest"], points=int(o["points"]))
                                    for o in origins.iter_rows(named=True)))


__all__ = ["ReusedFrom", "SweepTally", "tally_reuse"]
