"""The user's own traffic from files: a request trace, or a recorded list of per-step token counts.

**Request trace** (:func:`read_trace`): CSV with a header, JSON Lines (one object per line) or parquet, one
request per row with columns ``arrival_s`` (seconds from the start, >= 0), ``prompt_tokens`` and ``output_tokens``
(integers >= 1). Extra columns are ignored. Every bad row is refused at once, by its line (CSV: the header is
line 1; JSONL: the first object is line 1; parquet: rows count from 1) with the reason, e.g.
``line 7: prompt_tokens '12.5' is not an integer >= 1``. Rows may come in any order: they are sorted by arrival.

**Step list** (:func:`read_steps`): one integer per line (a text or CSV file of a single column; a header line
``num_tokens`` or ``tokens`` is allowed) or a JSON list -- e.g. the batch sizes a server logged per forward pass.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

from sp_lab.serving.traffic import Request, Traffic

__all__ = ["TRACE_COLUMNS", "TraceError", "read_steps", "read_trace"]

TRACE_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")
"""The columns a request trace needs."""
_MAX_SHOWN = 10


class TraceError(ValueError):
    """A trace or step file with bad rows; the message lists them by line."""


def _int_at_least_1(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 1 else None
    if isinstance(value, float):
        return int(value) if value.is_integer() and value >= 1 else None
    if isinstance(value, str):
        try:
            return _int_at_least_1(int(value.strip()))
        except ValueError:
            return None
    return None


def _seconds(value: object) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x >= 0 else None


def _problems(rows: Iterable[tuple[int, Mapping[str, object]]]) -> tuple[list[Request], list[str]]:
    requests, problems = [], []
    for line, row in rows:
        missing = [c for c in TRACE_COLUMNS if c not in row or row[c] in (None, "")]
        if missing:
            problems.append(f"line {line}: missing {', '.join(missing)}")
            continue
        arrival = _seconds(row["arrival_s"])
        prompt, output = _int_at_least_1(row["prompt_tokens"]), _int_at_least_1(row["output_tokens"])
        bad = []
        if arrival is None:
            bad.append(f"arrival_s {row['arrival_s']!r} is not a number of seconds >= 0")
        for name, parsed in (("prompt_tokens", prompt), ("output_tokens", output)):
            if parsed is None:
                bad.append(f"{name} {row[name]!r} is not an integer >= 1")
        if bad:
            problems.append(f"line {line}: " + "; ".join(bad))
        else:
            requests.append(Request(arrival, prompt, output))  # type: ignore[arg-type]
    return requests, problems


def _refuse(path: Path, problems: list[str], what: str) -> None:
    shown = problems[:_MAX_SHOWN]
    more = f"\n  ... and {len(problems) - _MAX_SHOWN} more" if len(problems) > _MAX_SHOWN else ""
    raise TraceError(f"{path}: {len(problems)} bad {what}:\n  " + "\n  ".join(shown) + more)


def read_trace(path: str | Path, *, concurrency: int | None = None) -> Traffic:
    """The requests of a trace file (module docstring) as :class:`Traffic` (open loop, or closed loop with at
    most ``concurrency`` in flight). :class:`TraceError` lists every bad row by line."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"no trace file {path}")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            if not set(TRACE_COLUMNS) <= set(header):
                raise TraceError(f"{path}: the header (line 1) must name {', '.join(TRACE_COLUMNS)}; it has {header}")
            # DictReader's line_num is the physical line just read: the header is line 1
            rows = [(reader.line_num, row) for row in reader]
        requests, problems = _problems(rows)
    elif suffix in (".jsonl", ".ndjson"):
        parsed, problems = [], []
        for line, text in enumerate(path.read_text().splitlines(), start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                problems.append(f"line {line}: not JSON ({e.msg})")
                continue
            if not isinstance(obj, dict):
                problems.append(f"line {line}: expected an object with {', '.join(TRACE_COLUMNS)}, got {type(obj).__name__}")
                continue
            parsed.append((line, obj))
        requests, more = _problems(parsed)
        problems += more
    elif suffix == ".parquet":
        import polars as pl

        frame = pl.read_parquet(path)
        missing = [c for c in TRACE_COLUMNS if c not in frame.columns]
        if missing:
            raise TraceError(f"{path}: no column {', '.join(missing)}; it has {frame.columns}")
        requests, problems = _problems(enumerate(frame.select(TRACE_COLUMNS).iter_rows(named=True), start=1))
    else:
        raise TraceError(f"{path}: unknown trace format {suffix!r}; use .csv, .jsonl or .parquet")
    if problems:
        _refuse(path, problems, "rows")
    if not requests:
        raise TraceError(f"{path}: no requests in the file")
    return Traffic.of(requests, concurrency=concurrency, name=path.name, source=f"trace {path}")


def read_steps(path: str | Path) -> list[int]:
    """Per-step token counts from a file (module docstring); :class:`TraceError` lists bad lines."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"no step file {path}")
    text = path.read_text()
    if path.suffix.lower() == ".json":
        data = json.loads(text)
        if not isinstance(data, list):
            raise TraceError(f"{path}: expected a JSON list of token counts, got {type(data).__name__}")
        lines = [(i, v) for i, v in enumerate(data, start=1)]
        where = "item"
    else:
        lines = [(i, s.strip()) for i, s in enumerate(text.splitlines(), start=1) if s.strip()]
        if lines and lines[0][1].lower() in ("num_tokens", "tokens"):
            lines = lines[1:]
        where = "line"
    steps, problems = [], []
    for i, value in lines:
        parsed = _int_at_least_1(value)
        if parsed is None:
            problems.append(f"{where} {i}: {value!r} is not a token count (an integer >= 1)")
        else:
            steps.append(parsed)
    if problems:
        _refuse(path, problems, f"{where}s")
    if not steps:
        raise TraceError(f"{path}: no step token counts in the file")
    return steps
