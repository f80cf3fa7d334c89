"""Reading a JSON document that a user hands sp_lab: a file path, or the JSON text itself.

One reader for the configs and rules people send each other, so every format fails the same clear way:
the error names the file (or says it was given text), and says what the input is not -- not UTF-8 text
(a pickle, a zip), not valid JSON (cut short, empty), or neither JSON text nor the path of a file.
It never runs anything: the bytes are decoded and handed to :func:`json.loads`, nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_json"]

# JSON text a user may paste: an object or an array (an array is then refused by the caller, with its type).
_JSON_STARTS = ("{", "[")


def read_json(path_or_text: str | Path, *, what: str, error: type[Exception] = ValueError) -> Any:
    """The parsed JSON value of a file (a ``Path``, or a ``str`` naming an existing file) or of JSON text
    (a ``str`` starting with ``{`` or ``[``).

    ``what`` names the document in messages (``"config"``, ``"rule"``); ``error`` is the exception raised
    for content that is not JSON. A ``str`` that is neither JSON text nor a plausible path (control
    characters, several lines) raises ``error``; a plausible path that does not exist raises
    ``FileNotFoundError`` naming it.
    """
    if isinstance(path_or_text, str) and path_or_text.lstrip()[:1] in _JSON_STARTS:
        return _parse(path_or_text, source=f"{what} text", error=error)
    if isinstance(path_or_text, str) and not _could_be_a_path(path_or_text):
        raise error(
            f"{what}: {path_or_text[:40]!r}{'...' if len(path_or_text) > 40 else ''} is neither JSON text "
            "(which starts with '{') nor the path of a file"
        )
    path = Path(path_or_text)
    if not path.is_file():
        raise FileNotFoundError(
            f"no such {what} file: {str(path)!r} (pass a path to an existing file or JSON text)"
        )
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(
            f"{path}: not a JSON {what} file (not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start}; "
            "a pickle, a zip or another binary file?)"
        ) from None
    return _parse(text, source=str(path), error=error)


def _parse(text: str, *, source: str, error: type[Exception]) -> Any:
    if not text.strip():
        raise error(f"{source}: empty, not valid JSON")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        # The decoder stopped at the end of the text, or inside a string that never closes before it.
        cut_short = e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string")
        raise error(
            f"{source}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}"
            f"{'; the text ends early: a copy cut short?' if cut_short else ''})"
        ) from None


def _could_be_a_path(text: str) -> bool:
    # A file name has no control characters and no line breaks; pasted binary or a wrong paste has.
    return bool(text) and len(text) < 4096 and all(ch.isprintable() for ch in text)
