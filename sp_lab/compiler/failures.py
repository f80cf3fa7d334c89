"""Turning the two known boundary failures of strategy ``none`` into :class:`BoundaryError`, and nothing else.

SP leaves the residual as a token shard ``[ceil(N/tp), H]``; with boundary ``none`` it crosses a piece
boundary that was compiled for ``[N, H]`` in one of two ways, each failing with an error we can check:

- as a piece output: the next piece's Inductor input guard raises ``AssertionError("expected size
  6==12, stride 64==64 at dim=0")`` when called. Inductor gives that guard no exception type of its own,
  so it is recognised by three facts together: the message has ``assert_size_stride``'s format, the
  assertion was raised inside the piece's generated code (a file in Inductor's cache directory), and an
  argument really has the reported size at that dimension;
- through functionalization's epilogue ``copy_(residual, shard)``: Inductor fails while compiling with
  ``expand: attempting to expand a dimension of length ((s0 + 1)//2) -> s0!`` and the pass recorded a
  kept copy with exactly those two sizes.

Any other error -- including an unrelated Inductor failure in a piece that also kept a copy -- passes
through untouched, with its own traceback.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir

from sp_lab.compiler.report import BoundaryFailure, PieceRecord
from sp_lab.compiler.shape_text import format_shape, format_symbols

if TYPE_CHECKING:
    from sp_lab.compiler.report import RangeReport

__all__ = ["BoundaryError", "copy_epilogue_failure", "explain", "guard_inputs", "in_range"]

_GUARD = re.compile(r"expected size (\d+)==(\d+), stride \d+==\d+ at dim=(\d+)")
_EXPAND = re.compile(r"expand: attempting to expand a dimension of length (.+) -> (.+)!")


class BoundaryError(RuntimeError):
    """SP broke a piece boundary (strategy ``none``); the report's ``failures`` holds the details."""


def copy_epilogue_failure(error: BaseException, record: PieceRecord | None) -> BoundaryFailure | None:
    """The failure ``error`` is, if it is the kept ``copy_`` of ``record`` failing to expand; else None."""
    kept = [c for c in (record.copies if record is not None else ()) if c.action == "kept"]
    for message in _messages(error):
        found = _EXPAND.search(message)
        if not found:
            continue
        for copy in kept:
            if _first_dim(copy.src_shape) == found[1].strip() and _first_dim(copy.dst_shape) == found[2].strip():
                return BoundaryFailure(record.index, copy.target, "copy_epilogue", copy.dst_shape, copy.src_shape,
                                       found[0])
    return None


def guard_inputs(fn: Callable, record: Callable[[], PieceRecord], report: RangeReport) -> Callable:
    """``fn`` (a compiled piece) with Inductor's input-guard failure turned into :class:`BoundaryError`.

    ``record`` gives the piece's record (its input specs) when a failure needs explaining.
    """

    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except AssertionError as e:
            failure = _input_guard_failure(e, record(), args)
            if failure is None:
                raise
            failure = in_range(failure, report.lo, report.hi)
            report.failures.append(failure)
            raise BoundaryError(explain(failure, report.boundary)) from e

    return run


def explain(failure: BoundaryFailure, boundary: str = "none") -> str:
    """The :class:`BoundaryError` message: the model's name for the tensor, both shapes with the token count
    written ``N`` (as the explorer's tables write them), the fix, and Inductor's words in the same notation
    (the raw text stays in ``failure.message`` and in the chained exception)."""
    where = f" in range [{failure.lo}, {failure.hi}]" if failure.lo is not None else ""
    return (
        f"boundary='{boundary}'{where}: sequence parallelism sharded tensor {failure.tensor!r} at piece "
        f"{failure.piece} ({failure.check} failed: expected shape {format_shape(failure.expected_shape)}, got "
        f"{format_shape(failure.actual_shape)}, N = tokens in the forward). The residual leaves the piece as a "
        "token shard while the next piece was compiled for the full token count. Use boundary='gather' "
        "(re-gather at every boundary) or 'sharded' (keep the residual sharded and compile pieces for it). "
        "Inductor said: " + format_symbols(failure.message)
    )


def in_range(failure: BoundaryFailure, lo: int, hi: int) -> BoundaryFailure:
    """``failure`` as it happened in the token range ``[lo, hi]``."""
    return dataclasses.replace(failure, lo=lo, hi=hi)


def _input_guard_failure(error: AssertionError, record: PieceRecord, args: tuple) -> BoundaryFailure | None:
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    found = _GUARD.search(message)
    if not found or not _raised_in_generated_code(error):
        return None
    actual, dim = int(found[1]), int(found[3])
    for spec, arg in zip(record.inputs, args):
        if isinstance(arg, torch.Tensor) and spec.shape and arg.dim() > dim and arg.shape[dim] == actual:
            return BoundaryFailure(record.index, spec.name, "assert_size_stride", spec.shape, tuple(arg.shape), message)
    return None


def _raised_in_generated_code(error: BaseException) -> bool:
    """Whether the innermost Python frame of ``error`` is in a module Inductor generated (its cache dir)."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    try:
        return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(Path(cache_dir()).resolve())
    except (OSError, ValueError):
        return False


def _messages(error: BaseException) -> list[str]:
    """The messages of ``error`` and every exception it was raised from."""
    seen, out = set(), []
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        out.append(str(error))
        error = error.__cause__ or error.__context__
    return out


def _first_dim(shape: tuple | None) -> str | None:
    return str(shape[0]).strip() if shape else None
