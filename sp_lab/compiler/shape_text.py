"""Symbolic shapes as people read them: the token count is ``N`` and a token shard ``ceil(N/2)``.

sp_lab makes only the token dimension symbolic, so every compiler symbol (``s37``, ``s72``, ...) in a shape or
in Inductor's messages is the forward's token count. The failure messages, the explorer and the tables all
write shapes through this module, so a message and the table beside it say the same thing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["format_shape", "format_size", "format_symbols"]

_SYMBOL = re.compile(r"\bs\d+\b")
_CEIL_DIV = re.compile(r"\(\(N \+ (\d+)\)//(\d+)\)")
_FLOOR_DIV = re.compile(r"\(N//(\d+)\)")
_WRAPPED = re.compile(r"\(((?:ceil|floor)\(N/\d+\))\)")


def format_symbols(text: str) -> str:
    """Every compiler size expression in ``text`` in the model's terms: ``((s37 + 1)//2) -> s37`` reads
    ``ceil(N/2) -> N``."""
    text = _SYMBOL.sub("N", text)
    text = _CEIL_DIV.sub(lambda m: (f"ceil(N/{m[2]})" if int(m[1]) + 1 == int(m[2])
                                    else f"floor((N+{m[1]})/{m[2]})"), text)
    text = _FLOOR_DIV.sub(lambda m: f"floor(N/{m[1]})", text)
    while _WRAPPED.search(text):
        text = _WRAPPED.sub(r"\1", text)
    return text


def format_size(size: int | str) -> str:
    """One dimension: ``"((s37 + 1)//2)"`` -> ``"ceil(N/2)"``; ints stay as they are."""
    return str(size) if isinstance(size, int) else format_symbols(str(size))


def format_shape(shape: Sequence[int | str] | None) -> str:
    """``["((s37 + 1)//2)", 4096]`` -> ``"[ceil(N/2), 4096]"``; ``"[?]"`` when unknown."""
    if shape is None:
        return "[?]"
    return "[" + ", ".join(format_size(d) for d in shape) + "]"
