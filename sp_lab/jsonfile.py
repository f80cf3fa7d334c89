"""Reading JSON: a document a user hands sp_lab (a file path, or the JSON text itself), and the one strict
loader that checks parsed JSON against type annotations (:class:`TypedJSON`: the compile report and LabConfig).

One reader for the configs and rules people send each other, so every format fails the same clear way:
the error names the file (or says it was given text), and says what the input is not -- not UTF-8 text
(a pickle, a zip), not valid JSON (cut short, empty), or neither JSON text nor the path of a file.
It never runs anything: the bytes are decoded and handed to :func:`json.loads`, nothing else.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import errno
import json
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, NoReturn

__all__ = ["TypedJSON", "json_kind", "read_json", "type_name"]

# JSON text a user may paste: an object or an array (an array is then refused by the caller, with its type).
_JSON_STARTS = ("{", "[")


def _neither(text: str, what: str) -> str:
    return (f"{what}: {text[:40]!r}{'...' if len(text) > 40 else ''} is neither JSON text (which starts with '{{' or "
            "'[') nor the path of a file")


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
        raise error(_neither(path_or_text, what))
    path = Path(path_or_text)
    try:
        is_file = path.is_file()
    except OSError as e:
        if e.errno != errno.ENAMETOOLONG:
            raise
        raise error(_neither(str(path_or_text), what)) from None  # longer than any file name: text, not a path
    if not is_file:
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


# -- typed JSON: parsed JSON checked against type annotations and built into typed values -----------------------

# Decoders pass the path of the value they check as a chain ``(parent, key)``, rendered only for an error
# (``ranges[1].pieces[0].op_counts_after['mm']``): formatting it for every value made loading reports 2x slower.
_Path = str | tuple


class TypedJSON:
    """The one strict loader of typed JSON: parsed JSON checked against a type annotation and built into it.

    Dataclasses (by their fields' annotations; unknown fields refused, required ones demanded), ``Literal``
    and ``Enum`` choices, ``X | None`` and ``int | str`` unions, lists, fixed and variable tuples, dicts, and
    ``int`` / ``float`` / ``bool`` / ``str`` (a bool is never an int). A bad value raises ``error`` naming its
    path, what it should hold and what it holds (``ranges[1].pieces[0].decision: expected one of 'fuse',
    'no_fuse', got str 'maybe'``). The compile report and :class:`~sp_lab.config.LabConfig` both load with it.

    ``what`` prefixes every message (``"compile report"``); ``derived`` names fields a class writes and
    recomputes on load (accepted, ignored); ``hooks`` build a type with its own loader (a ``ValueError`` it
    raises is reported at the value's path); ``built``: the values are a Python caller's, so a record must
    already be an instance (a dict is refused). Decoders are made once per type (reports are big).
    """

    def __init__(self, error: type[Exception], what: str = "", *,
                 derived: Mapping[type, tuple[str, ...]] | None = None,
                 hooks: Mapping[type, Callable[[Any], Any]] | None = None,
                 built: bool = False):
        self.error, self.what, self.built = error, what, built
        self.derived = dict(derived or {})
        self.hooks = dict(hooks or {})
        self._decoders: dict[Any, Callable[[Any, _Path], Any]] = {}

    def decode(self, tp: Any, value: Any, path: str = "") -> Any:
        """``value`` (parsed JSON, or Python values of the same shapes) checked against ``tp`` and built."""
        return self.decoder(tp)(value, path)

    def fail(self, path: _Path, message: str) -> NoReturn:
        where = _render(path)
        raise self.error(f"{self.what + ': ' if self.what else ''}{where + ': ' if where else ''}{message}")

    def decoder(self, tp: Any) -> Callable[[Any, _Path], Any]:
        made = self._decoders.get(tp)
        if made is None:
            made = self._decoders[tp] = self._make(tp)
        return made

    def _make(self, tp: Any) -> Callable[[Any, _Path], Any]:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        name, fail = type_name(tp), self.fail
        if tp is Any:
            return lambda value, path: value
        if tp in self.hooks:
            return self._hooked(self.hooks[tp])
        if origin in (typing.Union, types.UnionType):
            return self._union(args, name)
        if origin is Literal:
            return self._choice({a: a for a in args})
        if dataclasses.is_dataclass(tp):
            return self._record(tp)
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return self._choice({m.value: m for m in tp})
        if origin in (list, tuple):
            return self._sequence(origin, args, name)
        if origin is dict or tp is dict:
            key, val = (self.decoder(args[0]), self.decoder(args[1])) if args else (self.decoder(str), self.decoder(Any))

            def mapping(value: Any, path: _Path) -> Any:
                if not isinstance(value, dict):
                    fail(path, f"expected {name}, got {json_kind(value)}")
                return {key(k, (path, f"[{k!r}]")): val(v, (path, f"[{k!r}]")) for k, v in value.items()}

            return mapping
        if tp is float:

            def real(value: Any, path: _Path) -> Any:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    fail(path, f"expected float, got {json_kind(value)}")
                return float(value)

            return real
        if tp is int:

            def integer(value: Any, path: _Path) -> Any:
                if isinstance(value, bool) or not isinstance(value, int):
                    fail(path, f"expected int, got {json_kind(value)}")
                return value

            return integer

        def plain(value: Any, path: _Path) -> Any:
            if not isinstance(value, tp):
                fail(path, f"expected {name}, got {json_kind(value)}")
            return value

        return plain

    def _hooked(self, hook: Callable[[Any], Any]) -> Callable[[Any, _Path], Any]:
        def hooked(value: Any, path: _Path) -> Any:
            try:
                return hook(value)
            except ValueError as e:
                self.fail(path, str(e))

        return hooked

    def _union(self, args: tuple, name: str) -> Callable[[Any, _Path], Any]:
        options = [self.decoder(a) for a in args if a is not type(None)]
        nullable = type(None) in args
        # int | str sizes: a JSON value of exactly one of these types needs no trial decoding.
        exact = frozenset(a for a in args if a in (int, str, bool))
        error = self.error

        def union(value: Any, path: _Path) -> Any:
            if value is None and nullable:
                return None
            if type(value) in exact:
                return value
            if len(options) == 1:
                return options[0](value, path)  # its own error, naming the nested field
            for option in options:  # int | str sizes: the first that fits
                try:
                    return option(value, path)
                except error:
                    pass
            self.fail(path, f"expected {name}, got {json_kind(value)}")

        return union

    def _choice(self, members: dict[Any, Any]) -> Callable[[Any, _Path], Any]:
        allowed = ", ".join(map(repr, members))

        def choice(value: Any, path: _Path) -> Any:
            if not isinstance(value, str) or value not in members:
                close = difflib.get_close_matches(str(value), [str(m) for m in members], n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                self.fail(path, f"expected one of {allowed}, got {json_kind(value)}{hint}")
            return members[value]

        return choice

    def _sequence(self, origin: Any, args: tuple, name: str) -> Callable[[Any, _Path], Any]:
        fixed = origin is tuple and not (len(args) == 2 and args[1] is Ellipsis)
        items = [self.decoder(a) for a in args] if fixed else [self.decoder(args[0] if args else Any)]

        def sequence(value: Any, path: _Path) -> Any:
            if not isinstance(value, (list, tuple)):  # JSON has lists; Python callers may pass tuples
                self.fail(path, f"expected {name}, got {json_kind(value)}")
            if fixed:
                if len(value) != len(items):
                    self.fail(path, f"expected {len(items)} items, got {len(value)}")
                return tuple(d(v, (path, i)) for i, (d, v) in enumerate(zip(items, value, strict=True)))
            item = items[0]
            out = [item(v, (path, i)) for i, v in enumerate(value)]
            return tuple(out) if origin is tuple else out

        return sequence

    def _record(self, cls: type) -> Callable[[Any, _Path], Any]:
        fields = dataclasses.fields(cls)
        names = [f.name for f in fields]
        allowed = set(names) | set(self.derived.get(cls, ()))
        required = [f.name for f in fields if f.metadata.get("required")
                    or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)]
        hints = typing.get_type_hints(cls)
        decoders: dict[str, Callable[[Any, _Path], Any]] = {}

        def record(data: Any, path: _Path) -> Any:
            if isinstance(data, cls):  # a Python caller's record, already built (and checked when it was)
                return data
            if self.built:
                self.fail(path, f"expected {cls.__name__}, got {json_kind(data)}")
            if not isinstance(data, dict):
                self.fail(path, f"expected an object, got {json_kind(data)}")
            if not allowed.issuperset(data):
                self.fail(path, _unknown_fields(sorted(set(data) - allowed, key=str), names))
            missing = [n for n in required if n not in data]
            if missing:
                self.fail(path, f"missing field(s) {missing}")
            if not decoders:  # filled on first use: records may refer to each other
                decoders.update({n: self.decoder(hints[n]) for n in names})
            return cls(**{n: decoders[n](v, (path, n)) for n, v in data.items() if n in decoders})

        return record


def _unknown_fields(unknown: list[Any], names: list[str]) -> str:
    if len(unknown) == 1:
        close = difflib.get_close_matches(str(unknown[0]), names, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(names)}"
        return f"unknown field {unknown[0]!r}; {hint}"
    return f"unknown fields {', '.join(map(repr, unknown))}; known fields: {', '.join(names)}"


def _render(path: _Path) -> str:
    keys = []
    while isinstance(path, tuple):
        path, key = path
        keys.append(key)
    out = path
    for key in reversed(keys):
        if isinstance(key, int):
            out += f"[{key}]"
        elif key.startswith("["):
            out += key
        else:
            out = f"{out}.{key}" if out else key
    return out


def json_kind(value: Any) -> str:
    """How a bad value reads in an error: its type and (cut) repr, ``str '128'``."""
    return f"{type(value).__name__} {value!r:.60}"


def type_name(tp: Any) -> str:
    """How a type reads in an error: JSON's view (``list``, ``dict[str, int]``, ``int or str``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args if a is not type(None))
    if origin in (list, tuple):
        return "list"
    if origin is dict:
        return "dict" if args[1] is Any else f"dict[str, {type_name(args[1])}]"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "str"
    return getattr(tp, "__name__", None) or str(tp)
